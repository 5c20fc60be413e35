"""`gyre chaos`, smaller: a 3-step run with a stopped proxy, a killed proxy, a full log disk and a killed
satellite cell (real processes, real signals, RLIMIT_FSIZE on the live proxy). The full suite (20 faults
of every kind over 10 steps) is `gyre chaos integration/examples/chaos.toml`; its figures are in the
README. Several minutes on a loaded 2-core machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gyre.config.runconfig import load_config
from gyre.scenarios.chaos import chaos
from gyre.system.rundir import processes_of, segments_of
from gyre.trajsvc import ledger


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gyre_engine.server.model_factory import create_model

    return create_model(tmp_path_factory.mktemp("model") / "tiny")


def config(tmp_path: Path, model_dir: Path, steps: int) -> Path:
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        f"""
[run]
model_dir = "{model_dir}"
cells = 2
steps = {steps}
seed = 3
deadline_s = 1500.0
startup_timeout_s = 900.0
[batch]
queries = 2
group_size = 2
[agent]
turns = 2
max_tokens = 8
median_s = 4.0
timeout_s = 20.0
"""
    )
    return cfg


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_chaos_small_loses_nothing_and_trains_nothing_twice(tmp_path: Path, model_dir: Path) -> None:
    cfg = load_config(config(tmp_path, model_dir, steps=3))
    out = tmp_path / "chaos"
    kinds = ("stop-proxy", "kill-proxy", "disk-full", "kill-satellite")
    report = chaos(cfg, faults=4, seed=1, out=out, kinds=kinds)
    assert report == json.loads((out / "chaos.json").read_text())
    assert report["finished"], report["error"]
    assert report["injections"] == 4 and sorted(report["by_kind"]) == sorted(kinds)
    assert report["recovered"] == 4
    assert report["records_lost"] == 0 and report["records_trained_twice"] == 0, report["accounting"]
    for kind, r in report["by_kind"].items():
        assert r["injections"] == r["recovered"] == 1, kind
        assert r["time_to_recover_s"]["max"] is not None
    # The restarts the supervisor made: the proxy once, the satellite cell once, each back.
    parts = sorted(e["part"] for e in report["restarts"])
    assert parts == ["cell-1", "proxy"], report["restarts"]
    assert all(e["up_at"] is not None for e in report["restarts"])
    m = json.loads((out / "metrics.json").read_text())
    assert m["steps_applied"] == 3 and m["accounting"]["records_trained"] > 0
    trained = [e for r in ledger.read(out / ledger.LEDGER) for e in r["trained_executions"]]
    assert len(trained) == len(set(trained))
    assert processes_of(out) == [] and segments_of(out / "logs") == []
