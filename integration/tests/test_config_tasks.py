from __future__ import annotations

import random
from pathlib import Path

import pytest
from gyre import tasks as tasks_mod
from gyre.cli import main
from gyre.config import Config, ConfigError, config_from_dict, load_config
from gyre.predict import durations, sim_workload
from gyre.tasks import FAMILIES, eval_set, evaluate, make_task, run_tool
from gyre_traj.records import EvalStatus

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_examples_load() -> None:
    from gyre.harnesses import find_claude

    for p in sorted(EXAMPLES.glob("*.toml")):
        if p.name == "claude-code.toml" and find_claude() is None:  # refused, naming the key
            with pytest.raises(ConfigError, match=r"\[agent\] claude_bin"):
                load_config(p)
            continue
        cfg = load_config(p)
        assert cfg.run.cells >= 2


def test_defaults_and_yaml(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("run:\n  policy: colocate\n  steps: 3\nagent:\n  timeout_s: 5\n")
    cfg = load_config(p)
    assert cfg.run.policy == "colocate" and cfg.run.steps == 3
    assert cfg.agent.timeout_s == 5.0  # an int where a float is expected is fine
    assert cfg.batch == Config().batch


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "[run]\npolicy = 'fifo'\n",
            "[run] policy must be one of elastic, colocate, colocate-runahead, async",
        ),
        ("[run]\ncells = 1\n", "[run] cells must be >= 2"),
        ("[run]\nsteps = 'two'\n", "[run] steps must be int"),
        ("[agent]\nturn = 3\n", "[agent] unknown key 'turn'; known: call_retries, claude_bin, command"),
        ("[agent]\ntimeout_s = true\n", "[agent] timeout_s must be float, got True"),
        ("run = [1, 2]\n", "[run] must be a table, got list"),
        ("[agnet]\nturns = 3\n", "unknown section [agnet]"),
        ("[batch]\ngroup_size = 1\n", "[batch] group_size must be >= 2"),
        ("[run]\ncells = 2\n[sched]\nasync_train_cells = 2\n", "async_train_cells must be in [1, cells)"),
        ("[run\n", "Expected"),
    ],
)
def test_bad_configs_name_the_key(tmp_path: Path, text: str, message: str) -> None:
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=None) as err:
        load_config(p)
    assert message in str(err.value) and str(p) in str(err.value)


def test_config_error_is_gyre_scheds() -> None:
    # the section checks are gyre_sched.tables'; callers here still catch gyre.config.ConfigError
    from gyre_sched.tables import ConfigError as TableError

    assert issubclass(ConfigError, TableError) and issubclass(ConfigError, ValueError)
    with pytest.raises(ConfigError, match=r"^\[cell\] capacity must be int, got 2\.5$"):
        config_from_dict({"cell": {"capacity": 2.5}})


def test_cli_reports_config_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "bad.toml"
    p.write_text("[run]\npolicy = 'fifo'\n")
    assert main(["run", str(p)]) == 2
    assert "policy must be one of" in capsys.readouterr().err
    p.write_text("[run]\nstepz = 2\n")  # a gyre-sched table check, reported the same way
    assert main(["run", str(p)]) == 2
    assert "[run] unknown key 'stepz'; known: " in capsys.readouterr().err
    assert main(["run", str(tmp_path / "missing.toml")]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert main(["run", str(tmp_path / "c.ini")]) == 2


def test_tools() -> None:
    assert run_tool("calc", {"a": "3", "b": "7", "mode": "max"}) == ("7", False)
    assert run_tool("calc", {"a": "3", "b": "7", "mode": "low"}) == ("3", False)
    assert run_tool("count", {"word": "gradient", "field": "len"}) == ("8", False)
    assert run_tool("count", {"word": "gradient", "field": "count"}) == ("3", False)
    v, err = run_tool("lookup", {"item": "action", "key": "size"})
    assert not err and v.isdigit() and v == run_tool("lookup", {"item": " action", "key": "size"})[0]
    for bad in ({"a": "x", "b": "1", "mode": "max"}, {"a": "1", "b": "2", "mode": "mean"}, {}):
        out, err = run_tool("calc", bad)
        assert err and out.startswith("error")
    assert run_tool("lookup", {"item": "a;b", "key": "size"})[1] and run_tool("nope", {})[1]
    assert (
        all(len(e) >= 4 and e.isalpha() for e in tasks_mod.entities())
        and len(tasks_mod.entities()) == tasks_mod.ENTITIES
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_families_score_right_slipped_and_broken_answers(family: str) -> None:
    rng = random.Random(1)
    seen = set()
    for i in range(30):
        t = make_task(rng, f"t{i}", family=family)
        seen.add(t.prompt)
        step = t.script[0]
        assert run_tool(step.name, step.arguments) == (t.answer, False)
        assert all(
            v in t.prompt for v in step.arguments.values()
        )  # the call's arguments come from the question
        assert evaluate(t, "e", "g", f" {t.answer}.\n", timed_out=False).value == 1.0
        slip = evaluate(t, "e", "g", t.slip[1], timed_out=True)
        assert slip.timed_out and slip.value == (1.0 if t.slip[1] == t.answer else 0.5)
        assert evaluate(t, "e", "g", "I think it is", timed_out=False).value == 0.0
    assert len(seen) > 20


def test_an_evaluation_failure_is_not_a_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    t = make_task(random.Random(0), "t")
    failed = evaluate(t, "e", "g", None, timed_out=False, error="HarnessError: 400")
    assert failed.status is EvalStatus.EVAL_FAILED and failed.value is None

    def broken(task: object) -> list[tuple[str, object]]:
        raise KeyError("no such test")

    monkeypatch.setattr(tasks_mod, "_unit_tests", broken)
    s = evaluate(t, "e", "g", t.answer, timed_out=False)
    assert s.status is EvalStatus.EVAL_FAILED and s.value is None and "no such test" in s.detail


def test_held_out_split_never_reaches_training() -> None:
    held = {(t.family, t.prompt) for t in eval_set(48)}
    assert len(held) == 48  # distinct questions
    rng = random.Random(5)
    train = {(t.family, t.prompt) for t in (make_task(rng, f"x{i}") for i in range(3000))}
    assert len(train) > 250 and not held & train  # many instances, not a few fixed words
    assert eval_set(12) == eval_set(12) and [t.family for t in eval_set(3)] == list(FAMILIES)


def test_run_and_simulator_share_one_duration_sample() -> None:
    cfg = load_config(EXAMPLES / "tiny.toml")
    d = durations(cfg)
    assert d.shape == (cfg.run.steps, cfg.batch.queries, cfg.batch.group_size)
    assert (d == durations(cfg.with_policy("async", "x"))).all()
    w = sim_workload(cfg)
    assert w.run.cells == cfg.run.cells and w.timeout_s == pytest.approx(cfg.agent.timeout_s)


def test_streaming_is_declared_once_and_the_simulator_gets_the_runs() -> None:
    """`[driver] streaming` (default on) decides whether the run streams steps, except under the Colocate
    variants (whole batches only); the simulator `gyre compare` predicts with is given the same flag, and
    each compare arm's `:streaming` / `:whole` overrides it."""
    from gyre.compare import arm_config
    from gyre.config import POLICIES

    cfg = Config()
    assert cfg.driver.streaming
    expect = {"elastic": True, "colocate": False, "colocate-runahead": False, "async": True}
    assert set(expect) == set(POLICIES)
    for policy, streams in expect.items():
        c = cfg.with_policy(policy, "x")
        assert c.streams is streams and sim_workload(c).driver.streaming is streams
    assert not arm_config(cfg, "elastic:whole", "x").streams
    assert sim_workload(arm_config(cfg, "elastic:whole", "x")).driver.streaming is False
    off = arm_config(cfg, "elastic:whole", "x")
    assert arm_config(off, "async:streaming", "x").streams
    assert arm_config(off, "async", "x").streams is False  # the config's own setting
    with pytest.raises(ConfigError, match="arm 'fifo'"):
        arm_config(cfg, "fifo", "x")
    with pytest.raises(ConfigError, match="arm 'elastic:sometimes'"):
        arm_config(cfg, "elastic:sometimes", "x")
