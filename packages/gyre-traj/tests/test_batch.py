"""Call batches (columnar records): round trips, the tree's batch ingest against per-call ingest, errors
that name the call and leave the tree as it was, and the memcmp prefix comparison."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest
from gyre_traj import tree as tree_mod
from gyre_traj.io import Codec, batch_calls, encode_msgpack_stream, iter_msgpack, read_records, write_records
from gyre_traj.records import Call, CallBatch, RecordError, Score, defer_input_sign_check
from gyre_traj.synth import SynthConfig, synth_execution, synth_group
from gyre_traj.tree import ExecutionTree, Forest
from hypothesis import given, settings
from hypothesis import strategies as st

from .helpers import OUT, SYS, TOOL, USER, call, ids

PROMPT = ids(SYS, 1, 2, 3) + ids(USER, 1, 2)


def small_cfg(**kw: object) -> SynthConfig:
    base: dict[str, object] = dict(
        main_calls=24,
        max_context=6_000,
        system_tokens=40,
        summary_tokens=30,
        output_tokens=(2, 30),
        compactions=2,
        subagents=3,
        subagent_calls=3,
        retries=3,
        drifts=2,
    )
    base.update(kw)
    return SynthConfig(**base)  # type: ignore[arg-type]


def tree_state(t: ExecutionTree) -> dict[str, object]:
    """Everything observable about a tree (arrays, calls, leaves, stats)."""
    s = t.stats
    return {
        "n": t.n,
        **{k: getattr(t, k).tolist() for k in ("ids", "parent", "depth", "policy", "logprob", "version")},
        "calls": {cid: msgspec.structs.asdict(info) for cid, info in t.calls.items()},
        "order": list(t.order),
        "leaves": sorted(leaf.call_id for leaf in t.leaves()),
        "policy_tokens": t.policy_tokens,
        "stats": (s.calls, s.call_tokens, s.delta_calls, s.output_matched_existing, s.context_promoted),
        "drifts": list(s.drifts),
    }


def batch_vs_per_call(*batches: list[Call]) -> tuple[ExecutionTree, list[str], ExecutionTree]:
    """Ingest `batches` with `add_batch`, noting the calls that took `add`'s comparing path (`_add`), and
    the same calls one by one; the two trees must be equal. Returns (batch tree, compared call ids, the
    per-call tree)."""
    compared: list[str] = []
    real_add = ExecutionTree._add

    def counting_add(self: ExecutionTree, call_id: str, *args: object, **kw: object) -> object:
        compared.append(call_id)
        return real_add(self, call_id, *args, **kw)  # type: ignore[arg-type]

    t = ExecutionTree("e")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ExecutionTree, "_add", counting_add)
        for b in batches:
            t.add_batch(CallBatch.of(b))
    ref = ExecutionTree("e")
    for b in batches:
        for c in b:
            ref.add(c)
    assert tree_state(t) == tree_state(ref)
    return t, compared, ref


def test_batch_round_trips_its_calls() -> None:
    calls = synth_execution(small_cfg(seed=3), "x")
    batch = CallBatch.of(calls)
    back = list(batch.calls())
    assert len(back) == len(calls)
    for a, b in zip(calls, back, strict=True):
        assert a.call_id == b.call_id and a.role == b.role and a.weight_version == b.weight_version
        assert (a.input_delta is None) == (b.input_delta is None)
        if a.input_delta is not None:
            assert b.input_delta is not None
            assert (a.input_delta.parent, a.input_delta.keep) == (b.input_delta.parent, b.input_delta.keep)
            assert a.input_delta.append.tolist() == b.input_delta.append.tolist()
        else:
            assert a.input_ids is not None and b.input_ids is not None
            assert a.input_ids.tolist() == b.input_ids.tolist()
        assert a.output_ids.tolist() == b.output_ids.tolist()
        assert np.array_equal(a.output_logprobs, b.output_logprobs)
        assert (a.t_start, a.t_end) == (b.t_start, b.t_end)


@pytest.mark.parametrize("suffix", [".jsonl", ".msgpack"])
def test_batches_in_files(tmp_path: Path, suffix: str) -> None:
    recs = list(synth_group(small_cfg(), "g", 3, eval_failures=1))
    path = tmp_path / f"recs{suffix}"
    write_records(path, recs, batch=7)
    stored = list(read_records(path))
    assert any(isinstance(r, CallBatch) for r in stored)
    assert sum(len(r) for r in stored if isinstance(r, CallBatch)) == sum(isinstance(r, Call) for r in recs)
    assert sum(isinstance(r, Score) for r in stored) == 3
    a = Forest().add_all(recs)
    b = Forest().add_all(stored)
    assert {t.execution_id for t in a} == {t.execution_id for t in b}
    for t in a:
        assert tree_state(t) == tree_state(b.trees[t.execution_id])
        assert t.score == b.trees[t.execution_id].score


def test_batch_calls_groups_per_execution_and_keeps_order() -> None:
    recs = list(synth_group(small_cfg(main_calls=6, subagents=0, retries=0, drifts=0), "g", 2))
    out = list(batch_calls(recs, max_calls=4))
    per_exec: dict[str, list[str]] = {}
    for r in out:
        if isinstance(r, CallBatch):
            assert 1 <= len(r) <= 4
            per_exec.setdefault(r.execution_id, []).extend(r.call_ids)
    want: dict[str, list[str]] = {}
    for r in recs:
        if isinstance(r, Call):
            want.setdefault(r.execution_id, []).append(r.call_id)
    assert per_exec == want
    with pytest.raises(ValueError, match="max_calls"):
        list(batch_calls(recs, max_calls=0))


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    delta=st.booleans(),
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    retries=st.integers(0, 4),
    drifts=st.integers(0, 3),
    subagents=st.integers(0, 3),
)
def test_batch_ingest_equals_per_call_ingest(
    seed: int, delta: bool, sizes: list[int], retries: int, drifts: int, subagents: int
) -> None:
    calls = synth_execution(
        small_cfg(seed=seed, delta=delta, retries=retries, drifts=drifts, subagents=subagents), "x"
    )
    ref = ExecutionTree("x")
    for c in calls:
        ref.add(c)
    t = ExecutionTree("x")
    i, k = 0, 0
    while i < len(calls):  # batches of the given sizes, cycling
        size = sizes[k % len(sizes)]
        t.add_batch(CallBatch.of(calls[i : i + size]))
        i, k = i + size, k + 1
    assert tree_state(t) == tree_state(ref)
    # and through the framed stream, where the sign check moves into the tree's copy
    f = Forest().add_msgpack(encode_msgpack_stream(calls, batch=sizes[0]))
    assert tree_state(f.trees["x"]) == tree_state(ref)


def test_batch_of_calls_placed_without_comparison_mixes_with_ones_that_need_it() -> None:
    a1, a2 = ids(OUT, 1, 2), ids(OUT, 3)
    calls = [
        call("c0", PROMPT, a1),
        call("c1", None, a2, delta=("c0", 7, ids(TOOL, 1))),  # fast: extends all of c0
        call("c1-retry", None, ids(OUT, 9), delta=("c0", 7, ids(TOOL, 1))),  # a retry of c1: a branch
        call("c2", None, ids(OUT, 4), delta=("c1", 9, ids(TOOL, 2))),  # fast again
        call("s0", ids(SYS, 50, 51), ids(OUT, 5), agent="sub"),  # a new root branch
    ]
    t, compared, _ = batch_vs_per_call(calls)
    # all were placed without looking at the tree (c0: the tree was empty; c1-retry: same input as
    # the call before it, an output that starts differently)
    assert compared == []
    assert t.call_sequence("c2")[0].tolist() == PROMPT + a1 + ids(TOOL, 1) + a2 + ids(TOOL, 2)
    assert t.call_sequence("s0")[0].tolist() == ids(SYS, 50, 51)


def test_first_call_of_an_empty_tree_is_placed_and_root_calls_after_it_compare_with_it() -> None:
    """The first call of an empty tree is placed with its stretch (copied later), so the root-branch
    test of the calls after it in the same batch must still see its first token."""
    calls = [
        call("c0", PROMPT, ids(OUT, 1)),  # placed: the tree is empty
        call("s0", ids(SYS, 1, 9), ids(OUT, 2), agent="sub"),  # shares c0's first token: compared
        call("s1", ids(SYS, 60, 61), ids(OUT, 3), agent="sub1"),  # a new root branch: placed
        call("s2", ids(SYS, 60, 62), ids(OUT, 4), agent="sub2"),  # shares s1's first token: compared
        call("c1", None, ids(OUT, 5), delta=("c0", 6, ids(TOOL, 1))),  # c0's end has no child: placed
    ]
    t, compared, _ = batch_vs_per_call(calls)
    assert compared == ["s0", "s2"]
    assert len(t.children(-1)) == 2  # c0 (with s0 below its first token) and s1 (with s2)
    for c in calls:
        assert t.call_sequence(c.call_id)[1].tolist() == c.output_ids.tolist()


def test_calls_without_output_in_a_batch_mark_no_policy_tokens() -> None:
    """A placed call without output adds an empty policy segment: policy flags, drift detection and
    branch points around it are those of per-call ingest."""
    calls = [
        call("c0", PROMPT, ids(OUT, 1, 2)),
        call("c1", None, [], delta=("c0", 7, ids(TOOL, 1))),  # no output
        call("c2", None, ids(OUT, 3, 4), delta=("c1", 8, ids(TOOL, 2))),  # placed after it
        call(
            "c3", None, ids(OUT, 5), delta=("c2", 10, ids(OUT, 9) + ids(TOOL, 3))
        ),  # contradicts OUT+4: drift
        call("c4", None, ids(OUT, 6), delta=("c1", 8, ids(TOOL, 5))),  # branches after c1's context: no drift
        call("c5", None, [], delta=("c4", 10, ids(TOOL, 6))),  # no output, then the batch ends
    ]
    t, _, _ = batch_vs_per_call(calls)
    assert [d.call_id for d in t.stats.drifts] == ["c3"]
    assert t.policy_tokens == 2 + 2 + 1 + 1


def test_retries_placed_as_branches_or_compared() -> None:
    """A call with the same delta parent, keep and appended input as the (placed) call before it is a
    retry: its output is placed as a branch at the end of that input when no child there starts like
    it; otherwise (or when anything differs) it is compared. Either way the tree is per-call ingest's."""
    calls = [
        call("c0", PROMPT, ids(OUT, 1, 2)),
        call("c1", None, ids(OUT, 3, 4), delta=("c0", 7, ids(TOOL, 1, 2))),
        call("r1", None, ids(OUT, 5), delta=("c0", 7, ids(TOOL, 1, 2))),  # placed: a branch
        call("c2", None, ids(OUT, 6), delta=("r1", 10, ids(TOOL, 3))),  # extends the retry: placed
        call("r2", None, ids(OUT, 7), delta=("c2", 11, ids(TOOL, 3))),  # c2's output follows TOOL 3: compared
        call("c3", None, ids(OUT, 8, 9), delta=("c2", 12, ids(TOOL, 4))),
        call("r3", None, ids(OUT, 8, 1), delta=("c2", 12, ids(TOOL, 4))),  # starts like c3's output: compared
        call("c4", None, ids(OUT, 2), delta=("c3", 15, ids(TOOL, 5))),
        call("r4", None, ids(OUT, 3), delta=("c3", 15, ids(TOOL, 6))),  # another input: compared
        call("c5", None, ids(OUT, 4), delta=("c4", 17, ids(TOOL, 7))),
        call("r5", None, ids(OUT, 5), delta=("c4", 17, ids(TOOL, 7))),  # placed
        call(
            "r5b", None, ids(OUT, 5), delta=("c4", 17, ids(TOOL, 7))
        ),  # r5 is not placed before it: compared
        call("c6", None, ids(OUT, 6), delta=("c5", 19, ids(TOOL, 8))),
        call("r6", None, ids(OUT, 7), delta=("c5", 18, ids(TOOL, 8))),  # another keep: compared
    ]
    t, compared, _ = batch_vs_per_call(calls)
    assert compared == ["r2", "r3", "r4", "r5b", "r6"]
    for c in calls:
        assert t.call_sequence(c.call_id)[1].tolist() == c.output_ids.tolist()
    c1_in = t.calls["c1"].end - 2  # the retry branches where c1's input ends
    assert t.children(c1_in) == [c1_in + 1, t.calls["r1"].end]


def test_calls_branching_inside_their_parents_input() -> None:
    """A call that keeps part of its parent's input and appends to it is placed as a new branch when its
    first appended token starts no child of the node it continues and that node is context; else it is
    compared (a child starts the same way, the node is a policy token: drift or not). Either way the
    tree, drifts included, is per-call ingest's."""
    calls = [
        call("c0", PROMPT, ids(OUT, 1, 2)),
        call("c1", None, ids(OUT, 3), delta=("c0", 7, ids(TOOL, 1, 2))),
        call("b1", None, ids(OUT, 4), delta=("c1", 3, ids(USER, 7, 8))),  # after SYS 3, context: placed
        call("b2", None, ids(OUT, 5), delta=("c1", 3, ids(USER, 1, 9))),  # USER 1 follows SYS 3: compared
        call("b3", None, ids(OUT, 6), delta=("c1", 3, ids(USER, 7, 9))),  # b1 branched with USER 7: compared
        call("b4", None, ids(OUT, 7), delta=("c1", 7, ids(OUT, 9))),  # after OUT 2 (policy): compared
        call("b5", None, ids(OUT, 8), delta=("c1", 6, ids(TOOL, 9))),  # inside c0's output: compared, drift
        call("c2", None, ids(OUT, 1), delta=("b1", 6, ids(TOOL, 3))),  # extends b1 (in this stretch): placed
        call(
            "b6", None, ids(OUT, 2), delta=("c2", 5, ids(TOOL, 4))
        ),  # inside b1's part of c2's input: placed
    ]
    for split in (len(calls), 2):  # one batch; the branching calls in a later batch than their parents
        t, compared, ref = batch_vs_per_call(*(calls[i : i + split] for i in range(0, len(calls), split)))
        if split == len(calls):
            assert compared == ["b2", "b3", "b4", "b5"]
        assert [d.call_id for d in t.stats.drifts] == [d.call_id for d in ref.stats.drifts]
    assert [d.call_id for d in ref.stats.drifts] == ["b5"]


def codec_frame(rec: CallBatch) -> bytes:
    payload = Codec().encode_msgpack(rec)
    return len(payload).to_bytes(4, "little") + payload


def _stream_with_bad_call(bad: str) -> tuple[list[Call], bytes]:
    good = [
        call("c0", PROMPT, ids(OUT, 1, 2)),
        call("c1", None, ids(OUT, 3), delta=("c0", 7, ids(TOOL, 1))),
    ]
    later = [
        call("c2", None, ids(OUT, 4), delta=("c1", 9, ids(TOOL, 2))),
        call("c3", None, ids(OUT, 5), delta=("c2", 11, ids(TOOL, 3))),
    ]
    if bad == "negative":
        ok = CallBatch.of([call("c2", None, ids(OUT, 4, 5), delta=("c1", 9, ids(TOOL, 2)))])
        with defer_input_sign_check():  # as a decoder inside Forest.add_msgpack would
            neg = CallBatch(**{**msgspec.structs.asdict(ok), "tokens": np.array([3002, 4004, -7], np.int32)})
        return good, encode_msgpack_stream(good) + codec_frame(neg)
    elif bad == "unknown-parent":
        later.append(call("c4", None, ids(OUT, 6), delta=("nope", 3, ids(TOOL, 4))))
    elif bad == "too-long-keep":
        later.append(call("c4", None, ids(OUT, 6), delta=("c3", 99, ids(TOOL, 4))))
    elif bad == "duplicate":
        later.append(call("c0", PROMPT, ids(OUT, 8)))
    return good, encode_msgpack_stream(good) + encode_msgpack_stream(later, batch=10)[len(b"GYRETITO\x01") :]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("negative", r"call='c2'.*output ids contain a negative id -7 at position 1"),
        ("unknown-parent", r"call='c4'.*unknown parent call 'nope'"),
        ("too-long-keep", r"call='c4'.*keep=99 exceeds parent 'c3'"),
        ("duplicate", r"call='c0'.*duplicate call id"),
    ],
)
def test_bad_call_in_a_batch_names_it_and_changes_nothing(bad: str, message: str) -> None:
    good, stream = _stream_with_bad_call(bad)
    ref = ExecutionTree("e")
    for c in good:
        ref.add(c)
    f = Forest()
    with pytest.raises(RecordError, match=message):
        f.add_msgpack(stream)
    assert tree_state(f.trees["e"]) == tree_state(ref)
    # the tree still takes good calls afterwards
    f.trees["e"].add_batch(CallBatch.of([call("c9", None, ids(OUT, 7), delta=("c1", 9, ids(TOOL, 5)))]))
    assert f.trees["e"].call_sequence("c9")[0].tolist() == PROMPT + ids(OUT, 1, 2) + ids(TOOL, 1) + ids(
        OUT, 3
    ) + ids(TOOL, 5)


def _with_negative_id(calls: list[Call], call_id: str) -> CallBatch:
    """A batch of `calls` where the last output id of `call_id` is -7 (as decoded from a stream, where
    the tree checks the sign)."""
    ok = CallBatch.of(calls)
    k = ok.call_ids.index(call_id)
    toks = ok.tokens.copy()
    toks[int(np.sum(ok.input_lens[: k + 1]) + np.sum(ok.output_lens[: k + 1])) - 1] = -7
    with defer_input_sign_check():
        return CallBatch(**{**msgspec.structs.asdict(ok), "tokens": toks})


@pytest.mark.parametrize(
    ("later", "message"),
    [
        # c3 is placed too: the negative id is found when the placed tokens are copied, at the end
        (
            call("c3", None, ids(OUT, 5), delta=("c2", 11, ids(TOOL, 3))),
            r"call='c2'.*negative id -7 at position 1",
        ),
        # c3 is compared and fails: the negative id of c2, placed before it, is still the error
        (
            call("c3", None, ids(OUT, 5), delta=("nope", 3, ids(TOOL, 3))),
            r"call='c2'.*negative id -7 at position 1",
        ),
        # c3 is compared against c2's tokens (still in the batch, not yet copied) and is fine itself
        (
            call("c3", None, ids(OUT, 6), delta=("c1", 9, ids(TOOL, 2))),
            r"call='c2'.*negative id -7 at position 1",
        ),
    ],
)
def test_negative_id_of_a_placed_call_is_reported_whatever_follows(later: Call, message: str) -> None:
    good = [call("c0", PROMPT, ids(OUT, 1, 2)), call("c1", None, ids(OUT, 3), delta=("c0", 7, ids(TOOL, 1)))]
    t = ExecutionTree("e")
    t.add_batch(CallBatch.of(good))
    before = tree_state(t)
    batch = _with_negative_id([call("c2", None, ids(OUT, 4, 5), delta=("c1", 9, ids(TOOL, 2))), later], "c2")
    with pytest.raises(RecordError, match=message):
        t.add_batch(batch)
    assert tree_state(t) == before


def test_compared_call_matches_placed_calls_not_yet_copied() -> None:
    """Placed calls are copied into the arena at the end of the batch; a compared call in between reads
    their tokens from the batch, also across the boundary with tokens the tree already held."""
    c0 = call("c0", PROMPT, ids(OUT, 1, 2))
    c1 = call("c1", None, ids(OUT, 3), delta=("c0", 7, ids(TOOL, 1, 2, 3)))
    # c0 and c1 are one run: c1-retry's input spans the tree's tokens (c0, from the first batch) and the
    # pending ones (c1's appended input) in one comparison; its output differs from c1's.
    batch = [
        c1,
        call("c1-retry", None, ids(OUT, 9), delta=("c0", 7, ids(TOOL, 1, 2, 3))),
        call("c2", PROMPT + ids(OUT, 1, 2) + ids(TOOL, 1, 2, 3) + ids(OUT, 3, 4), ids(OUT, 5)),  # full input
    ]
    t, _, _ = batch_vs_per_call([c0], batch)
    assert t.n == len(PROMPT) + 2 + 3 + 1 + 1 + 1 + 1  # c1-retry and c2 added only their new tokens


def test_malformed_batches_are_rejected_with_the_reason() -> None:
    batch = CallBatch.of([call("c0", PROMPT, ids(OUT, 1, 2)), call("c1", PROMPT, ids(OUT, 3))])
    fields = msgspec.structs.asdict(batch)
    cases = [
        ({"output_lens": np.array([2, 2])}, "add up to"),
        ({"logprobs": np.array([-0.1, -0.2])}, "3 output tokens, the batch holds 2 logprobs"),
        ({"call_ids": ["c0", "c0"]}, "call ids repeat"),
        ({"roles": [batch.roles[0]]}, "roles has 1 entries for 2 calls"),
        ({"keeps": np.array([0, -1])}, "keeps must be >= 0"),
        ({"parents": ["", "c1"]}, "names the call itself"),
        ({"parents": ["", ""], "keeps": np.array([0, 3])}, "without a delta parent"),
        (
            {"tokens": np.concatenate([batch.tokens[:-1], [-5]])},
            r"call='c1'.*output ids contain a negative id -5 at position 0",
        ),
        ({"t_start": np.array([0.0, np.nan])}, "NaN"),
    ]
    for change, message in cases:
        with pytest.raises(RecordError, match=message):
            CallBatch(**{**fields, **change})
    other = ExecutionTree("other")
    with pytest.raises(RecordError, match="given to the tree of 'other'"):
        other.add_batch(batch)


def test_decoded_batch_arrays_are_views() -> None:
    calls = synth_execution(small_cfg(seed=1), "x")
    data = encode_msgpack_stream(calls, batch=len(calls))
    (batch,) = list(iter_msgpack(data))
    assert isinstance(batch, CallBatch)
    assert not batch.tokens.flags.owndata and not batch.tokens.flags.writeable


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(0, 3000),
    at=st.one_of(st.none(), st.integers(0, 2999)),
    memcmp=st.booleans(),
)
def test_first_mismatch_matches_a_plain_scan(n: int, at: int | None, memcmp: bool) -> None:
    a = np.arange(n, dtype=np.int32)
    b = a.copy()
    if at is not None and at < n:
        b[at] = -1
    want = n if at is None or at >= n else at
    saved = tree_mod._MEMCMP
    if not memcmp:
        tree_mod._MEMCMP = None
    try:
        assert tree_mod._first_mismatch(a, b) == want
    finally:
        tree_mod._MEMCMP = saved


def test_memcmp_is_found_here() -> None:
    assert tree_mod._MEMCMP is not None  # Linux CI: the fast comparison is the one tested above
