"""The simulator: configs load strictly, invariants hold, and the 2.4T preset lands near the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gyre_sched.cli import main
from gyre_sched.sim import compare, run_one
from gyre_sched.workload import (
    ConfigError,
    load_workload,
    query_profile,
    sample_durations,
    workload_from_dict,
)


def test_preset_profile_matches_report() -> None:
    w = load_workload("2p4t")
    over, at_to = query_profile(sample_durations(w), w.timeout_s)
    assert abs(over - 0.611) < 0.05 and abs(at_to - 0.382) < 0.06


def test_bad_configs() -> None:
    with pytest.raises(ConfigError, match="unknown key 'stepz'"):
        workload_from_dict({"run": {"stepz": 3}})
    with pytest.raises(ConfigError, match="must be int"):
        workload_from_dict({"run": {"steps": "3"}})
    with pytest.raises(ConfigError, match="unknown section"):
        workload_from_dict({"runn": {}})
    with pytest.raises(ConfigError, match="no file or preset"):
        load_workload("nope")


def test_small_run_all_policies(tmp_path: Path) -> None:
    cfg = tmp_path / "w.json"
    cfg.write_text(
        json.dumps(
            {
                "run": {"steps": 6, "timeout_h": 2.0},
                "batch": {"queries": 4, "group_size": 2},
                "durations": {"median_h": 0.5},
                "cell": {"train_group_s": 120.0},
            }
        )
    )
    w = load_workload(cfg)
    for policy in ("elastic", "colocate", "async", "predictive"):
        for streaming in (True, False):
            r = run_one(w, policy, streaming=streaming)
            assert r.end_to_end_h > 0 and 0 <= r.idle_total <= 1
            assert r.timeouts <= 6 * 4 * 2
    rs = run_one(w, "elastic")
    assert all(d.why.capacity_after >= d.protects for d in rs.decisions)


@pytest.mark.slow
def test_preset_reproduces_report_ordering_and_ratios() -> None:
    results, s = compare(load_workload("2p4t"), predictive=False)
    hours = {r.policy: r.end_to_end_h for r in results}
    assert hours["elastic"] < hours["colocate"] < hours["async"]
    assert abs(s["speedup_vs_async"] / 1.78 - 1) <= 0.15
    assert abs(s["speedup_vs_colocate"] / 1.21 - 1) <= 0.15


def test_cli_simulate_writes_plot_and_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "w.toml"
    cfg.write_text(
        "[run]\nsteps = 4\ntimeout_h = 1.0\n[batch]\nqueries = 4\ngroup_size = 2\n[durations]\nmedian_h = 0.3\n"
    )
    png, log = tmp_path / "t.png", tmp_path / "d.jsonl"
    assert main(["simulate", str(cfg), "--plot", str(png), "--log", str(log)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {r["policy"] for r in last["results"]} == {"elastic", "colocate", "async", "predictive"}
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert lines and all("why" in x and "rule" in x for x in lines)
    assert main(["simulate", str(tmp_path / "missing.toml")]) == 2
