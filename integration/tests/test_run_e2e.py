"""`gyre run` end to end: real processes (gyre-sched, two cells with gyre-engine servers and a gyre-train
core/satellite, gyre-proxy), the built-in harness, two optimizer steps. About a minute on 2 cores."""

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


@pytest.mark.slow
def test_gyre_run_tiny(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(
        f"""
[run]
policy = "elastic"
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
    assert m["switches"] == len(m["decisions"]) >= 2  # the core had to move to training and back
    assert m["switches_to_training"] >= 1

    # No process of the run is left.
    assert _processes_mentioning(str(out)) == []
