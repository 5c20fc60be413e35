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
    for p in sorted(EXAMPLES.glob("*.toml")):
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
        ("[run]\npolicy = 'fifo'\n", "[run] policy must be one of elastic, colocate, async"),
        ("[run]\ncells = 1\n", "[run] cells must be >= 2"),
        ("[run]\nsteps = 'two'\n", "[run] steps must be int"),
        ("[agent]\nturn = 3\n", "[agent] unknown key 'turn'; known: exec_sigma, max_tokens, median_s"),
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
    assert run_tool("calculator", "(12+30)*2") == ("84", False)
    out, err = run_tool("calculator", "__import__('os')")
    assert err and out.startswith("error")
    assert run_tool("reverse", "gyre") == ("eryg", False)
    assert run_tool("count", "gradient") == ("letters 8, vowels 3", False)
    w, err = run_tool("weather", "Tarimo")
    assert not err and w == run_tool("weather", "tarimo")[0] and w.startswith("temp ")
    assert run_tool("weather", "x; rm")[1] and run_tool("nope", "x")[1]


@pytest.mark.parametrize("family", FAMILIES)
def test_families_score_right_slipped_and_broken_answers(family: str) -> None:
    rng = random.Random(1)
    for i in range(20):
        t = make_task(rng, f"t{i}", family=family)
        step = t.script[0]
        assert run_tool(step.name, step.argument)[0] in (t.answer, run_tool(step.name, step.argument)[0])
        assert evaluate(t, "e", "g", f" {t.answer}.\n", timed_out=False).value == 1.0
        slip = evaluate(t, "e", "g", t.slip[1], timed_out=True)
        assert slip.value == 0.5 and slip.timed_out and t.slip[1] != t.answer
        assert evaluate(t, "e", "g", "I think it is", timed_out=False).value == 0.0
        # the tool's output holds the answer (arith, reverse) or names it among others (weather, letters)
        assert t.answer in run_tool(step.name, step.argument)[0]


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
    held = {(t.family, t.prompt) for t in eval_set(200)}
    assert len(held) > 150  # many instances, not a few fixed words
    rng = random.Random(5)
    train = {(t.family, t.prompt) for t in (make_task(rng, f"x{i}") for i in range(3000))}
    assert len(train) > 2500 and not held & train
    assert eval_set(12) == eval_set(12) and [t.family for t in eval_set(4)] == list(FAMILIES)


def test_run_and_simulator_share_one_duration_sample() -> None:
    cfg = load_config(EXAMPLES / "tiny.toml")
    d = durations(cfg)
    assert d.shape == (cfg.run.steps, cfg.batch.queries, cfg.batch.group_size)
    assert (d == durations(cfg.with_policy("async", "x"))).all()
    w = sim_workload(cfg)
    assert w.run.cells == cfg.run.cells and w.timeout_s == pytest.approx(cfg.agent.timeout_s)
