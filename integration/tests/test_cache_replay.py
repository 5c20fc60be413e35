"""The replay of a run's calls through gyre-engine's prefix cache (bench/cache_replay.py), on the records of a
real tiny run of the profile workload (`h200_agentic.py --cpu --tiny --policies elastic`: two engines,
compactions, sub-agents; contexts up to about 400 tokens)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from gyre.measure import prefixes
from gyre.trajsvc import recordlog
from gyre_traj.records import Call

from .benchmods import bench_module

DATA = Path(__file__).parent / "data" / "agentic-tiny"
RECORDS = DATA / "records-elastic.msgpack"
cr = bench_module("cache_replay")


@pytest.fixture(scope="module")
def records() -> list[Call]:
    return [c for _, c in recordlog.calls(RECORDS)]


def _sizes(device: int, host: int, slot: int = 1 << 20, long_slots: int = 0) -> Any:
    return cr.Sizes(device, host, slot, 1024, long_slots, 64)


def test_a_cache_that_keeps_everything_finds_the_own_engine_ideal(records: list[Call]) -> None:
    own = prefixes.prefix_hits(records)["prefix_cache_hit_share_own_engine"]
    res = cr.replay(records, _sizes(1 << 30, 0))
    assert res["hit_share"] == own
    assert res["host_hit_share"] == 0.0
    # the run's own engines found at most that
    assert res["measured_hit_share"] <= own
    assert sum(e["calls"] for e in res["per_engine"].values()) == len(records)


def test_a_device_budget_of_one_context_loses_hits_and_the_host_tier_gives_them_back(
    records: list[Call],
) -> None:
    everything = cr.replay(records, _sizes(1 << 30, 0))["hit_share"]
    small = cr.replay(records, _sizes(450, 0))  # about one context of the tiny run
    tier = cr.replay(records, _sizes(450, 1 << 16))
    assert small["hit_share"] < everything
    assert small["host_hit_share"] == 0.0
    assert tier["host_hit_share"] > 0.0
    assert small["hit_share"] < tier["hit_share"] <= everything


def test_long_slots_hold_their_contexts_in_place_and_give_the_least_recent_to_the_host(
    records: list[Call],
) -> None:
    # every call passes a 16-token decode slot: each takes one of the long slots, whose contexts stay
    # cached in place (no device budget at all) until another call takes the slot
    one = cr.replay(records, _sizes(0, 0, slot=16, long_slots=1))
    six = cr.replay(records, _sizes(0, 0, slot=16, long_slots=6))
    six_host = cr.replay(records, _sizes(0, 1 << 16, slot=16, long_slots=6))
    assert one["hit_share"] < six["hit_share"] < six_host["hit_share"]
    # each call's own output length as its max_new_tokens (the default): every call still passes 16
    assert cr.replay(records, cr.Sizes(0, 0, 16, 1024, 6))["hit_share"] == six["hit_share"]
    assert six["host_hit_share"] == 0.0 < six_host["host_hit_share"]
    # a call that finds every slot busy is counted (it would wait for one in the engine)
    assert sum(e["long_waits"] for e in one["per_engine"].values()) > 0


def test_a_new_weight_version_clears_the_engine_cache(records: list[Call]) -> None:
    first = min(r.t_start for r in records)
    last = max(r.t_start for r in records)
    mid = first + (last - first) / 2
    later = [msgspec.structs.replace(r, weight_version=r.weight_version + 1) if r.t_start > mid else r
             for r in records]  # fmt: skip
    base = cr.replay(records, _sizes(1 << 30, 0))["hit_share"]
    bumped = cr.replay(later, _sizes(1 << 30, 0))["hit_share"]
    assert bumped < base
    assert bumped == prefixes.prefix_hits(later)["prefix_cache_hit_share_own_engine"]


def test_the_command_line_reads_a_run_folder_and_writes_one_replay_per_host_size(
    records: list[Call], tmp_path: Path
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "records.msgpack").write_bytes(RECORDS.read_bytes())
    out = tmp_path / "replay.json"
    argv = [str(run), "--host-tokens", "0,65536", "--max-cached-tokens", "450", "--out", str(out)]
    assert cr.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["calls"] == len(records)
    assert [r["sizes"]["host_cached_tokens"] for r in res["replays"]] == [0, 65536]
    assert res["replays"][0]["hit_share"] < res["replays"][1]["hit_share"]


def _call(cid: str, version: int, t0: float, t1: float, ids: list[int]) -> Call:
    from gyre_traj.records import Role

    out = np.array([7, 8], dtype=np.int64)
    return Call(
        execution_id=f"e-{cid}", call_id=cid, agent_id="main", role=Role.MAIN, output_ids=out,
        output_logprobs=np.zeros(2, dtype=np.float32), weight_version=version,
        input_ids=np.array(ids, dtype=np.int64), t_start=t0, t_end=t1, metadata={"engines": "0"},
    )  # fmt: skip


def test_a_long_slot_is_free_again_when_its_call_ends_under_an_older_version() -> None:
    """One long slot. "a" holds it across a weight update ("b", the engine's first call of the new version,
    clears the cache); when "a" ends its KV is stale and stays out of the cache, but its slot is free:
    "c" takes it rather than waiting for it."""
    calls = [
        _call("a", 0, 0.0, 10.0, list(range(1, 41))),
        _call("b", 1, 5.0, 6.0, list(range(100, 140))),
        _call("c", 1, 11.0, 12.0, list(range(200, 240))),
    ]
    res = cr.replay(calls, cr.Sizes(0, 0, 16, 1024, 1))
    assert res["per_engine"]["0"]["long_waits"] == 1  # "b": "a" holds the slot
    assert res["per_engine"]["0"]["calls"] == 3


def test_the_replays_recorded_calls_carry_whole_inputs_and_engines(records: list[Call]) -> None:
    """bench/replay.py's `recorded_calls` (what the standalone engines serve again): every call in start
    order, with its whole input as the prefix measures resolve it and the engine that served it."""
    replay = bench_module("replay")
    got = replay.recorded_calls(RECORDS)
    full = prefixes.full_inputs(records)
    by_id = {r.call_id: r for r in records}
    assert len(got) == len(records) and [c.t_start for c in got] == sorted(r.t_start for r in records)
    for c in got:
        r = by_id[c.call_id]
        assert c.input_ids == full[c.call_id].tolist() and c.output_len == r.output_ids.size
        assert c.engine == prefixes.serving_engine(r) != ""
