from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from gyre.cli import main
from gyre.config.runconfig import Config, ConfigError, config_from_dict, load_config
from gyre.measure.predict import durations, sim_workload
from gyre.rollout.tasks import qa as tasks_mod
from gyre.rollout.tasks.qa import FAMILIES, eval_set, evaluate, make_task, run_tool
from gyre_traj.records import EvalStatus

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_examples_load() -> None:
    from gyre.rollout.harnesses import check_harness, find_claude

    for p in sorted(EXAMPLES.glob("*.toml")):
        if p.name == "claude-code.toml" and find_claude() is None:  # refused, naming the key
            with pytest.raises(ConfigError, match=r"\[agent\] claude_bin"):
                check_harness(load_config(p).agent)
            continue
        cfg = load_config(p)
        check_harness(cfg.agent)
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


def test_config_error_is_gyre_bases() -> None:
    # the section checks are gyre_base.tables'; callers here still catch gyre.config.runconfig.ConfigError
    from gyre_base.tables import ConfigError as TableError

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


def test_tools_read_the_tasks_state_and_refuse_bad_calls() -> None:
    rng = random.Random(3)
    calc = make_task(rng, "c", family="calc", cue="larger")
    x, y = (int(v) for v in calc.subject)
    got = {op: run_tool(calc, "calc", {"op": op}) for op in ("add", "sub", "max")}
    assert got == {
        "add": (str(x + y), False),
        "sub": (str(abs(x - y)), False),
        "max": (str(max(x, y)), False),
    }
    assert calc.answer == str(max(x, y)) and calc.choice == "max"
    m = make_task(rng, "m", family="measure", cue="old")
    values = {k: run_tool(m, "get", {"key": k}) for k in ("size", "age", "length")}
    assert all(not err and v.isdigit() for v, err in values.values()) and m.answer == values["age"][0]
    assert run_tool(m, "get", {"key": " age "}) == values["age"]
    for task, name, args in ((calc, "calc", {"op": "mean"}), (calc, "calc", {}), (m, "calc", {"op": "add"}),
                             (m, "get", {"key": "weight"}), (m, "nope", {})):  # fmt: skip
        out, err = run_tool(task, name, args)
        assert err and out.startswith("error"), (name, args)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_choice_gives_its_own_value_and_only_the_cued_call_scores(family: str) -> None:
    """The reward's signal: of a question's three well-formed calls exactly the cued one passes the call's
    unit test, and copying its result passes the other; a wrong call copied scores 0, the right call
    with a wrong answer 0.5. So sampled calls differ in reward, and the reward reads the model's call."""
    rng = random.Random(1)
    seen = set()
    for i in range(60):
        t = make_task(rng, f"t{i}", family=family)
        seen.add(t.prompt)
        assert t.fam.name == family and f" {t.cue}" in f" {t.prompt}"
        (step,) = t.script
        assert step.arguments == {t.fam.param: t.choice} and t.choice == t.fam.choice_of(t.cue)
        outs = {c: run_tool(t, t.fam.tool, {t.fam.param: c})[0] for c in t.fam.choices}
        assert len(set(outs.values())) == 3 and outs[t.choice] == t.answer  # the answer names the choice
        scores = {
            c: evaluate(t, "e", "g", f" {v}.\n", False, calls=[(t.fam.tool, {t.fam.param: c})]).value
            for c, v in outs.items()
        }
        assert scores == {c: (1.0 if c == t.choice else 0.0) for c in t.fam.choices}
        right = [(t.fam.tool, {t.fam.param: t.choice})]
        assert evaluate(t, "e", "g", "I think it is", False, calls=right).value == 0.5
        slow = evaluate(t, "e", "g", t.answer, timed_out=True, calls=right)
        assert slow.timed_out and slow.value == 1.0
        # the right answer without the model's own call (a scripted call, or none) keeps half
        assert evaluate(t, "e", "g", t.answer, False).value == 0.5
        # only the first call counts, and only the family's own tool
        other = "calc" if family == "measure" else "get"
        assert evaluate(t, "e", "g", t.answer, False, calls=[(other, {t.fam.param: t.choice})]).value == 0.5
        wrong = next(c for c in t.fam.choices if c != t.choice)
        assert (
            evaluate(t, "e", "g", "", False, calls=[(t.fam.tool, {t.fam.param: wrong}), *right]).value == 0.0
        )
    assert len(seen) > 30


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
    ev = eval_set(48)
    held = {(t.family, t.prompt) for t in ev}
    assert len(held) == 48  # distinct questions
    rng = random.Random(5)
    train = [make_task(rng, f"x{i}") for i in range(3000)]
    assert len({t.prompt for t in train}) > 150 and not held & {(t.family, t.prompt) for t in train}
    # what is held out: subjects (objects, number pairs) and the last phrasing never appear in training
    assert not {t.subject for t in ev} & {t.subject for t in train}
    assert {t.template for t in train} == {0, 1, 2}
    assert eval_set(12) == eval_set(12) and [t.family for t in eval_set(2)] == list(FAMILIES)
    # each family's questions ask for one choice, never the family's default
    for fam in FAMILIES:
        asked = {t.choice for t in ev if t.family == fam}
        assert asked == {tasks_mod.FAMILY[fam].cues[0][1]} and tasks_mod.FAMILY[fam].choices[0] not in asked


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
    from gyre.config.runconfig import POLICIES
    from gyre.measure.arms import arm_config

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


def test_only_the_models_own_calls_are_scored() -> None:
    """The driver and the evaluator score `Execution.model_calls()`: a call the scripted fallback made is
    not the model's, so it earns nothing; the model's call after it still counts."""
    from gyre.rollout.agents.agent import Execution, ToolSource, TurnLog

    t = make_task(random.Random(4), "t", family="measure")
    ex = Execution("e", "g", t, 0.0)
    right = json.dumps({"key": t.choice})
    ex.turns = [TurnLog(ToolSource.SCRIPT, (("get", right, t.answer),)), TurnLog(ToolSource.NONE)]
    assert (
        ex.model_calls() == [] and evaluate(t, "e", "g", t.answer, False, calls=ex.model_calls()).value == 0.5
    )
    ex.turns.insert(1, TurnLog(ToolSource.MODEL, (("get", right, t.answer),)))
    assert ex.model_calls() == [("get", {"key": t.choice})]
    assert evaluate(t, "e", "g", t.answer, False, calls=ex.model_calls()).value == 1.0
