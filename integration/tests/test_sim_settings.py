"""`bench/sim_settings.py`: the simulator at other timeouts, staleness bounds and call speeds, calibrated
as `gyre compare --reuse` calibrates (checked against `compare.predicted` on the committed H200 runs)."""

from __future__ import annotations

import json

import pytest
from gyre.config.runconfig import load_config
from gyre.scenarios.compare import predicted

from .benchmods import BENCH, bench_module

POLICIES = ("elastic", "colocate", "async")


@pytest.fixture(scope="module")
def runs() -> tuple[object, list[dict]]:
    cfg = load_config(BENCH.parent / "examples" / "h200-agentic.toml")
    return cfg, [json.loads((BENCH / f"metrics-h200-agentic-1206-{p}.json").read_text()) for p in POLICIES]


def test_at_the_runs_own_settings_it_predicts_what_compare_predicts(runs: tuple) -> None:
    cfg, measured = runs
    cal, rows = bench_module("sim_settings").table(
        cfg, measured, [cfg.agent.timeout_s], [cfg.driver.max_ahead], [1.0]
    )
    configs = {p: cfg.with_policy(p, cfg.run.out_dir) for p in POLICIES}
    want = predicted(cfg, configs, {p: [m] for p, m in zip(POLICIES, measured, strict=True)})
    assert want["calibration"]["model_call_s"] == pytest.approx(cal.model_call_s)
    got = rows[0]["end_to_end_s"]
    for row in want["rows"]:
        assert got[row["arm"]] == pytest.approx(row["predicted"]["end_to_end_s"], abs=0.06)


def test_a_longer_timeout_cuts_fewer_and_faster_calls_cut_fewer(runs: tuple) -> None:
    cfg, measured = runs
    _, rows = bench_module("sim_settings").table(cfg, measured, [120.0, 240.0], [1], [1.0, 0.8])
    cut = {(r["call_scale"], r["timeout_s"]): r["elastic_cut"] for r in rows}
    assert cut[(1.0, 240.0)] < cut[(1.0, 120.0)] and cut[(0.8, 120.0)] < cut[(1.0, 120.0)]
    assert all(r["executions"] == cfg.run.steps * cfg.batch.queries * cfg.batch.group_size for r in rows)
