"""The prefix cache's ideal hits against the measured ones, on the records of a real tiny run of the
profile workload (`h200_agentic.py --cpu --tiny --policies elastic`: two engines, compactions, sub-agents)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest
from gyre.measure import efficiency, prefixes
from gyre.trajsvc import recordlog
from gyre_traj.records import Call
from hypothesis import given, settings
from hypothesis import strategies as st

RECORDS = Path(__file__).parent / "data" / "agentic-tiny" / "records-elastic.msgpack"


@pytest.fixture(scope="module")
def records() -> list[Call]:
    return [c for _, c in recordlog.calls(RECORDS)]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# sequences over 3 tokens, so that they share prefixes, end inside each other's runs and part mid-run
_seqs = st.lists(st.lists(st.integers(0, 2), max_size=12), max_size=12)


@settings(max_examples=300, deadline=None)
@given(inserted=_seqs, queries=_seqs)
def test_the_radix_tree_matches_the_longest_common_prefix_with_any_inserted_sequence(
    inserted: list[list[int]], queries: list[list[int]]
) -> None:
    tree = prefixes.Radix()
    for i, seq in enumerate(inserted):
        tree.insert(np.asarray(seq, dtype=np.int64))
        # after every insertion, for what was inserted so far: every inserted sequence is held whole
        for q in [*queries, *inserted[: i + 1]]:
            want = max((_common_prefix(q, x) for x in inserted[: i + 1]), default=0)
            assert tree.match(np.asarray(q, dtype=np.int64)) == want
    assert prefixes.Radix().match(np.asarray([1, 2], dtype=np.int64)) == 0


def test_full_inputs_resolve_every_delta_to_the_lengths_the_run_measured(records: list[Call]) -> None:
    full = prefixes.full_inputs(records)
    assert len(full) == len(records)
    for r, n in efficiency.input_lengths(records):
        assert full[r.call_id].size == n
        if r.input_delta is not None:  # the kept part is the parent's input + output
            parent = next(p for p in records if p.call_id == r.input_delta.parent)
            whole = np.concatenate([full[parent.call_id], parent.output_ids])
            assert np.array_equal(full[r.call_id][: r.input_delta.keep], whole[: r.input_delta.keep])


def test_ideal_bounds_the_measured_and_the_misses_add_up(records: list[Call]) -> None:
    h = prefixes.prefix_hits(records)
    measured = efficiency.calls_and_cache(efficiency.input_lengths(records))
    assert h["prefix_cache_hit_share"] == measured["prefix_cache_hit_share"]
    assert h["input_tokens"] == measured["input_tokens"]
    assert h["calls_unresolved"] == 0
    ideal, own = h["prefix_cache_hit_share_ideal"], h["prefix_cache_hit_share_own_engine"]
    assert measured["prefix_cache_hit_share"] <= ideal < 1.0
    assert own <= ideal
    missed = h["missed_tokens"]
    assert sum(missed.values()) == measured["input_tokens"] - measured["cached_tokens"]
    # the run's calls that extend their agent's previous call: the ideal is their input less what each
    # appended (the tool output) and the one token an engine always computes
    ext = h["by_kind"]["extends"]
    appended = sum(
        int(r.input_delta.append.size) + 1
        for r in records
        if r.metadata.get("extends") and r.input_delta is not None
    )
    assert ext["ideal_tokens"] >= ext["input_tokens"] - appended
    # calls starting a conversation (first calls, sub-agents, after a compaction) share only the system
    # prompt and the group's task: most of what the run missed is theirs and the tool outputs'
    assert missed["inherent"] > missed["elsewhere"] + missed["lost_on_engine"]


def test_a_call_sent_to_the_engine_without_its_prefix_counts_as_elsewhere(records: list[Call]) -> None:
    # the same records, each extending call sent to the other engine than its parent's and its cache
    # hits gone: what the run had as hits on its own engine is now held elsewhere
    other = {"0": "1", "1": "0"}
    engine: dict[str, str] = {}
    moved = []
    for r in sorted(records, key=lambda r: r.t_start):
        e = r.metadata["engines"]
        if r.metadata.get("extends") and r.input_delta is not None:
            e = other[engine[r.input_delta.parent]]
            r = msgspec.structs.replace(r, metadata={**r.metadata, "engines": e, "cached_tokens": "0"})
        engine[r.call_id] = e
        moved.append(r)
    base, h = prefixes.prefix_hits(records), prefixes.prefix_hits(moved)
    assert h["prefix_cache_hit_share_ideal"] == base["prefix_cache_hit_share_ideal"]
    assert h["prefix_cache_hit_share_own_engine"] < base["prefix_cache_hit_share_own_engine"]
    # each moved call's own engine lacks at least its parent's output and what the parent appended
    lacks = sum(
        int(p.output_ids.size) + (int(p.input_delta.append.size) if p.input_delta is not None else 0)
        for r in records
        if r.metadata.get("extends") and r.input_delta is not None
        for p in records
        if p.call_id == r.input_delta.parent
    )
    assert h["missed_tokens"]["elsewhere"] >= lacks - h["by_kind"]["extends"]["calls"] > 0
    assert sum(h["missed_tokens"].values()) == h["input_tokens"] - sum(
        int(r.metadata.get("cached_tokens", 0)) for r in moved
    )
    # kept on its engine but not found there: lost on the engine
    lost = [
        msgspec.structs.replace(r, metadata={**r.metadata, "cached_tokens": "0"})
        if r.metadata.get("extends")
        else r
        for r in records
    ]
    h2 = prefixes.prefix_hits(lost)
    assert (
        h2["missed_tokens"]["lost_on_engine"]
        > base["missed_tokens"]["lost_on_engine"] + base["by_kind"]["extends"]["cached_tokens"] // 2
    )


def test_a_record_whose_parent_is_missing_is_left_out_and_counted(records: list[Call]) -> None:
    firsts = {r.call_id for r in records if r.input_ids is not None}
    rest = [r for r in records if r.call_id not in firsts]
    h = prefixes.prefix_hits(rest)
    assert h["calls_unresolved"] == len(rest)
    assert h["input_tokens"] == 0 and h["prefix_cache_hit_share_ideal"] is None


def test_a_prefix_of_an_earlier_weight_version_is_no_hit(records: list[Call]) -> None:
    # the same records, the calls from the middle of the run on generated by version 1 (the engines
    # dropped their caches at the new version: no hits at first)
    mid = float(np.median([r.t_start for r in records]))
    later = [
        msgspec.structs.replace(r, weight_version=1, metadata={**r.metadata, "cached_tokens": "0"})
        if r.t_start > mid
        else r
        for r in records
    ]
    base, h = prefixes.prefix_hits(records), prefixes.prefix_hits(later)
    assert base["missed_tokens"]["new_version"] == 0  # the tiny run applied its versions between batches
    assert h["prefix_cache_hit_share_any_version"] == base["prefix_cache_hit_share_ideal"]
    assert h["prefix_cache_hit_share_ideal"] < base["prefix_cache_hit_share_ideal"]
    assert h["missed_tokens"]["new_version"] > 0
    assert sum(h["missed_tokens"].values()) == h["input_tokens"] - sum(
        int(r.metadata.get("cached_tokens", 0)) for r in later
    )


def test_the_runs_efficiency_entry_carries_the_ideal_beside_the_measured(
    records: list[Call], tmp_path: Path
) -> None:
    from gyre.config.runconfig import Config
    from gyre.measure.trainwatch import TrainTrack

    eff = efficiency.efficiency(Config(), tmp_path, iter(records), [], TrainTrack([]), 0.0, 1.0)
    h = prefixes.prefix_hits(records)
    assert eff["prefix_cache_hit_share"] == h["prefix_cache_hit_share"]  # one pass over the records
    assert eff["prefix_cache_hit_share_ideal"] == h["prefix_cache_hit_share_ideal"]
    assert eff["prefix_cache"]["missed_tokens"] == h["missed_tokens"]
    assert eff["calls"] == len(records)
