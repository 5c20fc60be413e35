"""A run's recorded calls served again by standalone engines (bench/replay.py's `Engines` and
`serve_run_again`, as bench/h200_run.py's `replay` part runs them): real `gyre-engine serve` processes of
the tiny model on the CPU, the records of a real tiny run of the profile workload
(`h200_agentic.py --cpu --tiny --policies elastic`: two engines, compactions, sub-agents)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from gyre.config.runconfig import load_config

from .benchmods import BENCH, bench_module

DATA = Path(__file__).parent / "data" / "agentic-tiny"


def test_each_run_engines_calls_are_served_again_with_their_lengths_and_concurrency(tmp_path: Path) -> None:
    from gyre_engine.server.model_factory import create_model

    replay = bench_module("replay")
    h200_run = bench_module("h200_run")
    agentic = bench_module("h200_agentic")
    cfg = agentic.tiny(load_config(BENCH.parent / "examples" / "h200-agentic.toml"), str(tmp_path / "run"))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copy(DATA / "records-elastic.msgpack", run_dir / "records.msgpack")
    metrics = json.loads((DATA / "metrics-elastic.json").read_text())
    model_dir = create_model(tmp_path / "model", "tiny", seed=3)

    got = h200_run.replay_run(cfg, model_dir, run_dir, metrics, tmp_path, time.monotonic() + 300.0)

    calls = replay.recorded_calls(run_dir / "records.msgpack")
    engines = sorted({c.engine for c in calls})
    assert engines == ["0", "1"] and sorted(got["per_engine"]) == engines
    for e in engines:
        mine = [c for c in calls if c.engine == e]
        conc, busy = replay.concurrency_of(mine)
        r = got["per_engine"][e]
        # every call of that engine, each with exactly its recorded output length (the replay refuses
        # a call served to another length), at the engine's mean in-run concurrency
        assert r["calls"] == len(mine) and r["output_tokens"] == sum(c.output_len for c in mine)
        assert r["concurrency"] == max(1, round(conc)) and r["run_busy_s"] == round(busy, 3)
        # each execution's calls extend the one before, served in order: the prefix cache finds them
        assert r["prefix_cache_hit_share"] > 0.3
        assert 0 < r["wall_s"] <= got["standalone_s"]
        # the standalone engine's own counters over its replay: every output token decoded but each
        # call's first (sampled at prefill), in steps of at most the concurrency's rows (the CPU decodes
        # in lanes, a step at a time: no run of steps goes past a call's end)
        w = r["engine"]
        assert w["decode_steps"] > 0 and 1.0 <= w["mean_decode_batch"] <= r["concurrency"]
        decoded = w["decode_steps"] * w["mean_decode_batch"]
        assert decoded == pytest.approx(r["output_tokens"] - r["calls"], abs=w["decode_steps"] * 0.01)
        assert w["prefill_passes"] > 0 and w["prefill_graph_passes"] == 0  # the CPU has no graphs
    # held to the seconds with any call in flight on either engine, from the records ...
    _, in_flight = replay.concurrency_of(calls)
    assert got["calls_in_flight_s"] == round(in_flight, 3)
    assert max(got["per_engine"][e]["run_busy_s"] for e in engines) <= in_flight
    assert in_flight <= sum(got["per_engine"][e]["run_busy_s"] for e in engines) + 1e-3
    assert got["rollout_efficiency"] == pytest.approx(got["standalone_s"] / in_flight, rel=1e-3)
    # ... and, beside it, to the sampled busy rollout seconds of the device, which count whole sample
    # intervals: never fewer seconds than the calls were in flight
    busy_gpu = metrics["efficiency"]["device_seconds"]["rollout_busy_s"]
    assert got["rollout_busy_gpu_s"] == busy_gpu >= in_flight
    assert got["rollout_efficiency_sampled"] == pytest.approx(got["standalone_s"] / busy_gpu, rel=1e-3)
    assert got["standalone_startup_s"] > 0
    # the engines were stopped and their logs kept where the results' archive takes them
    logs = sorted(p.name for p in (tmp_path / "standalone-logs").glob("engine-alone-*.log"))
    assert logs == ["engine-alone-0.log", "engine-alone-1.log"]
