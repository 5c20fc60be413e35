"""Your own data and reward end to end on the CPU: `gyre run integration/examples/dataset.toml` (the
shipped arithmetic rows and reward, shortened by command-line overrides) with real processes, then
`gyre eval` on the policy the run exported, and once more with a reward that raises on one data source.
The scores are checked against the example's reward applied again to the answers each evaluation
recorded, so a score that did not come from the reward (or a failure counted as a 0) fails here. An
evaluation at every version holds steps 1 and 2 while rollout runs ahead of them (the run must still
finish). About 50-90 s on 2 cores."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gyre.cli import main
from gyre.config.runconfig import load_config
from gyre.rollout.evalset import eval_set_of
from gyre.rollout.tasks.reward import load_function

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CONFIG = EXAMPLES / "dataset.toml"
SHORT = ["run.steps=3", "batch.queries=2", "eval.tasks=4", "eval.every=1", "run.deadline_s=300"]
FLAKY = """
import importlib.util

spec = importlib.util.spec_from_file_location("arith_reward", {path!r})
arith = importlib.util.module_from_spec(spec)
spec.loader.exec_module(arith)


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if data_source == "arith/sub":
        raise RuntimeError("no subtraction today")
    return arith.compute_score(data_source, solution_str, ground_truth, extra_info)
"""


def _rescored(cfg_args: list[str], ev: dict[str, Any]) -> tuple[list[float], list[float]]:
    """The example's reward applied again to an evaluation's answers: (scores, has_number)."""
    cfg = load_config(CONFIG, cfg_args)
    tasks = eval_set_of(cfg).tasks
    fn = load_function(f"{EXAMPLES / 'arith_reward.py'}:compute_score")
    v = ev["version"]
    out = [
        fn(t.data_source, ev["answers"][f"eval-v{v}-{i:03d}"], t.ground_truth, t.extra_info)
        for i, t in enumerate(tasks)
    ]
    return [o["score"] for o in out], [o["has_number"] for o in out]


@pytest.mark.slow
def test_dataset_example_run_then_eval(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    args = [*SHORT, f"run.out_dir={out}"]
    assert main(["run", str(CONFIG), *args]) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["steps_applied"] == 3 and m["final_version"] == 3 and m["executions"] == 24
    # the run kept the overrides (what --resume would go on with) and the example's absolute paths
    run_cfg = json.loads((out / "run.json").read_text())["config"]
    assert run_cfg["batch"]["queries"] == 2 and run_cfg["tasks"]["train"] == str(
        EXAMPLES / "arith-train.jsonl"
    )
    # every execution made one call (a chat completion) and got one of the reward's three scores
    assert all(o["calls"] == 1 and o["score"] in (-1.0, 0.0, 1.0) for o in m["outcomes"])
    assert sum(s["loss_tokens"] for s in m["steps"]) > 0

    evals = [json.loads(x) for x in (out / "evals.jsonl").read_text().splitlines()]
    assert [e["version"] for e in evals] == [0, 1, 2, 3]  # steps 1 and 2 held for their evaluations
    for ev in evals:
        scores, has_number = _rescored(args, ev)
        assert ev["tasks"] == 4 and ev["eval_failed"] == 0
        assert ev["score"] == round(float(np.mean(scores)), 4)
        assert ev["reward_extra"] == {"has_number": round(float(np.mean(has_number)), 4)}
        assert set(ev["by_family"]) <= {"arith/add", "arith/sub"}

    # evaluation only, of the policy the run exported at its end: the run's evaluation, on the checkpoint
    capsys.readouterr()
    ev_dir = tmp_path / "eval"
    assert main(["eval", str(CONFIG), "--checkpoint", str(out / "policy"), "--out", str(ev_dir), *args]) == 0
    printed = capsys.readouterr().out
    (line,) = (ev_dir / "evals.jsonl").read_text().splitlines()
    ev = json.loads(line)
    assert set(ev) == set(evals[0]) | {"checkpoint"} and ev["checkpoint"] == str(out / "policy")
    scores, _ = _rescored(args, ev)
    assert ev["score"] == round(float(np.mean(scores)), 4) and ev["tasks"] == 4
    assert f"gyre eval: score {ev['score']} on 4 tasks" in printed
    assert json.loads(printed.strip().splitlines()[-1])["by_family"] == ev["by_family"]

    # a reward that raises is an evaluation failure, counted as such and not as a 0
    flaky = tmp_path / "flaky.py"
    flaky.write_text(FLAKY.format(path=str(EXAMPLES / "arith_reward.py")))
    again = ["eval", str(CONFIG), "--checkpoint", str(out / "policy"), "--out", str(ev_dir), *args]
    assert main([*again, f"tasks.reward={flaky}:compute_score"]) == 0
    ev2 = json.loads((ev_dir / "evals.jsonl").read_text().splitlines()[1])
    tasks = eval_set_of(load_config(CONFIG, args)).tasks
    subs = [i for i, t in enumerate(tasks) if t.data_source == "arith/sub"]
    adds = [i for i in range(len(tasks)) if i not in subs]
    assert subs and adds, "the example's first four evaluation rows hold both data sources"
    assert ev2["eval_failed"] == len(subs) and set(ev2["by_family"]) == {"arith/add"}
    assert set(ev2["failures"]) == {f"eval-v0-{i:03d}" for i in subs}
    assert all("raised RuntimeError: no subtraction today" in d for d in ev2["failures"].values())
    assert ev2["score"] == round(float(np.mean([scores[i] for i in adds])), 4)
