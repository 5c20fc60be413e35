"""`gyre run` end to end under each policy: real processes (gyre-sched, two cells with gyre-engine servers
and a gyre-train core/satellite, gyre-proxy), the built-in harness, two optimizer steps. About 50 s per
policy on 2 cores."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from gyre.cli import main
from gyre_traj.io import read_records
from gyre_traj.records import Call


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            found.append(f"{pid}: {cmd}")
    return found


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded tiny model, made once for the three runs."""
    from gyre_engine.server.model_factory import create_model

    return create_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["elastic", "colocate", "async"])
def test_gyre_run_tiny(tmp_path: Path, model_dir: Path, policy: str) -> None:
    out = tmp_path / "run"
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(
        f"""
[run]
model_dir = "{model_dir}"
policy = "{policy}"
cells = 2
steps = 2
out_dir = "{out}"
deadline_s = 300.0
[batch]
queries = 2
group_size = 2
[agent]
turns = 2
max_tokens = 8
median_s = 1.0
timeout_s = 6.0
"""
    )
    assert main(["run", str(cfg)]) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert (out / "timeline.png").stat().st_size > 0

    # Versions advanced: two updates, and the rollout engines serve the last one.
    assert m["steps_applied"] == 2 and m["final_version"] == 2
    assert [s["version"] for s in m["steps"]] == [1, 2]
    rollout = [c for c in m["final_cells"].values() if c["role"] == "rollout"]
    assert rollout and all(c["engine_version"] == "2" for c in rollout)

    # Every execution ran and was scored; each trained one is in exactly one step's mini-batch.
    assert m["executions"] == 8
    trained = [e for s in m["steps"] for e in s["trained_executions"]]
    assert len(trained) == len(set(trained))
    for s in m["steps"]:
        assert all(e.startswith(f"s{s['step']}-") for e in s["trained_executions"])

    # Records trained once: the loss tokens of each step are exactly the output tokens the proxy logged
    # for the executions it trained (no token twice, none left out).
    logged: dict[str, int] = {}
    versions: dict[str, list[int]] = {}
    for rec in read_records(out / "records.msgpack"):
        if isinstance(rec, Call):
            logged[rec.execution_id] = logged.get(rec.execution_id, 0) + len(rec.output_ids)
            versions.setdefault(rec.execution_id, []).append(rec.weight_version)
    assert m["records"] == sum(1 for _ in read_records(out / "records.msgpack"))
    for s in m["steps"]:
        assert (
            s["loss_tokens"] == sum(logged[e] for e in s["trained_executions"]) == s["output_tokens_recorded"]
        )
        assert s["staleness_max"] <= s["step"]
    # Batch 0 was sampled by the initial weights; nothing was sampled by a version not yet trained.
    assert all(v == 0 for e, vs in versions.items() if e.startswith("s0-") for v in vs)
    assert max(v for vs in versions.values() for v in vs) <= 2

    # The metrics are internally consistent.
    roles = m["roles"]
    for k in ("idle_rollout", "idle_training", "switching_share", "idle_total"):
        assert roles[k] is None or 0.0 <= roles[k] <= 1.0
    assert m["end_to_end_s"] > 0
    assert m["switches"] == len(m["decisions"])
    if policy == "async":  # the core moves to training once and stays there
        assert [(d["cell"], d["action"]) for d in m["decisions"]] == [(0, "TO_TRAINING")]
        assert m["final_cells"]["0"]["role"] == "training"
    else:  # the core had to move to training and back; colocate moves the whole pool
        assert m["switches_to_training"] >= (1 if policy == "elastic" else 2)
        assert m["final_cells"]["0"]["role"] == "rollout"
    assert {r for s in m["steps"] for r in s["by_replica"]} >= {"core"}

    # No process of the run is left.
    assert _processes_mentioning(str(out)) == []
