"""The live ingest path `Forest.ingest_frame`: an agent's next call read from its message's bytes
straight into its tree (the native half, `gyre_traj.native`, or `ExecutionTree.extend_next`), anything
else decoded in full. It builds the same tree as the plain path (each message decoded into a `Call` and
added), and refuses what the plain path refuses with the same error, the tree keeping what it had.
Every test here runs twice: with the native half in use and with it turned off (`live_path`)."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import numpy as np
import pytest
from gyre_traj.io import Codec, call_view_decoder, encode_msgpack_stream
from gyre_traj.records import Call, CallBatch, RecordError, Score
from gyre_traj.synth import SynthConfig, synth_execution
from gyre_traj.tree import CallInfo, ExecutionTree, Forest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .helpers import OUT, SYS, TOOL, USER, call, ids

pytestmark = pytest.mark.usefixtures("live_path")

CODEC = Codec()
PROMPT = ids(SYS, 1, 2) + ids(USER, 1)
ARRAYS = ("ids", "parent", "depth", "policy", "logprob", "version")


def _same_tree(a: ExecutionTree, b: ExecutionTree) -> None:
    for name in ARRAYS:
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.calls == b.calls and a.order == b.order and a.stats == b.stats


def _plain(frames: list[bytes]) -> Forest:
    forest = Forest()
    for f in frames:
        forest.add_frame(f)
    return forest


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    main_calls=st.integers(2, 40),
    compactions=st.integers(0, 3),
    subagents=st.integers(0, 3),
    retries=st.integers(0, 4),
    drifts=st.integers(0, 3),
    executions=st.integers(1, 3),
)
def test_ingest_frame_builds_the_plain_paths_tree(
    seed: int, main_calls: int, compactions: int, subagents: int, retries: int, drifts: int, executions: int
) -> None:
    """Random executions (compactions, sub-agents, retries, re-tokenization drift), several interleaved:
    every tree equals the one built from the same messages decoded into `Call`s, each call's CallInfo is
    the plain path's, and every call reads back exactly."""
    runs = [
        synth_execution(
            SynthConfig(
                main_calls=main_calls,
                max_context=3_000,
                compactions=compactions,
                subagents=subagents,
                subagent_calls=3,
                subagent_compactions=min(1, subagents),
                retries=retries,
                drifts=drifts,
                system_tokens=64,
                output_tokens=(0, 40),
                summary_tokens=32,
                seed=seed + i,
            ),
            f"e{i}",
        )
        for i in range(executions)
    ]
    order: list[Call] = []
    for k in range(max(map(len, runs))):  # round-robin, as records of parallel executions arrive
        order.extend(run[k] for run in runs if k < len(run))
    frames = [CODEC.encode_msgpack(c) for c in order]
    plain = _plain(frames)
    fast = Forest()
    for c, f in zip(order, frames, strict=True):
        info = fast.ingest_frame(f)
        assert info == plain.trees[c.execution_id].calls[c.call_id]
    for eid, tree in plain.trees.items():
        _same_tree(fast.trees[eid], tree)
        batched = Forest().add_msgpack(
            encode_msgpack_stream([c for c in order if c.execution_id == eid], 10**6)
        )
        for name in ARRAYS:
            assert np.array_equal(getattr(fast.trees[eid], name), getattr(batched.trees[eid], name)), name


def test_an_agents_next_call_takes_the_bytes_path() -> None:
    """The path exists and is taken: an agent's next call (and one whose parent ends inside the arena
    with nothing below it) goes in through `extend_next`, which the plain decode never calls."""
    cfg = SynthConfig(main_calls=30, max_context=5_000, subagents=2, subagent_compactions=1, retries=0)
    calls = synth_execution(cfg, "e")
    forest, dec, taken = Forest(), call_view_decoder(), 0
    for c in calls:
        frame = CODEC.encode_msgpack(c)
        tree = forest.trees.get("e")
        if tree is not None and (info := tree.extend_next(dec.decode(frame))) is not None:
            taken += 1
            assert info == tree.calls[c.call_id]
        else:
            forest.ingest_frame(frame)
    # All but each agent's first call (main and two sub-agents) and each agent's first call after a
    # compaction (three of the main agent's, one of a sub-agent's), which keep only the system prompt.
    assert taken == len(calls) - 3 - 3 - 1
    _same_tree(forest.trees["e"], _plain([CODEC.encode_msgpack(c) for c in calls]).trees["e"])


def _next_call_fields() -> tuple[dict[str, Any], dict[str, Any]]:
    """The first call of an execution and the agent's next call, as the msgpack maps the proxy sends."""
    first = call("c0", PROMPT, ids(OUT, 1))
    nxt = call("c1", None, ids(OUT, 2, 3), delta=("c0", 4, ids(TOOL, 1)))
    dec = msgspec.msgpack.Decoder(dict[str, Any])
    return dec.decode(CODEC.encode_msgpack(first)), dec.decode(CODEC.encode_msgpack(nxt))


def _ids(*xs: int) -> msgspec.msgpack.Ext:
    return msgspec.msgpack.Ext(1, np.array(xs, "<i4").tobytes())


def _lps(*xs: float) -> msgspec.msgpack.Ext:
    return msgspec.msgpack.Ext(2, np.array(xs, "<f4").tobytes())


BAD: list[tuple[str, dict[str, Any], str]] = [
    (
        "negative input id",
        {"input_delta.append": _ids(3001, -4)},
        r"input ids contain a negative id -4 at position 5",
    ),
    (
        "negative output id",
        {"output_ids": _ids(4002, -7)},
        r"output ids contain a negative id -7 at position 1",
    ),
    ("NaN logprob", {"output_logprobs": _lps(-0.5, math.nan)}, r"logprobs must be <= 0 \(and not NaN\)"),
    ("positive logprob", {"output_logprobs": _lps(-0.5, 0.25)}, r"logprobs must be <= 0"),
    ("logprob count", {"output_logprobs": _lps(-0.5)}, r"1 output logprobs for 2 output ids"),
    ("odd byte count", {"output_ids": msgspec.msgpack.Ext(1, b"\x01\x02\x03\x04\x05")}, r"holds 5 bytes"),
    ("unknown extension", {"output_ids": msgspec.msgpack.Ext(9, b"\x00" * 8)}, r"unknown msgpack extension"),
    ("unknown parent", {"input_delta.parent": "c9"}, r"unknown parent call 'c9'"),
    ("keep past the parent", {"input_delta.keep": 9}, r"input_delta.keep=9 exceeds parent"),
    ("duplicate call id", {"call_id": "c0", "input_delta.parent": "c0"}, r"names the call itself"),
    ("newer schema", {"v": 2}, r"schema version 2 is newer"),
    ("NaN timestamp", {"t_end": math.nan}, r"timestamps must not be NaN"),
    ("negative version", {"weight_version": -1}, r"weight_version must be >= 0"),
    ("version beyond int32", {"weight_version": 2**31}, r"weight_version must be <= 2147483647"),
    ("unknown field", {"colour": "red"}, r"unknown field `colour`"),
    ("both inputs", {"input_ids": _ids(1001)}, r"exactly one of input_ids / input_delta"),
    ("empty call id", {"call_id": ""}, r"execution_id and call_id must be non-empty"),
    ("empty execution id", {"execution_id": ""}, r"execution_id and call_id must be non-empty"),
]


@pytest.mark.parametrize(("what", "changes", "message"), BAD, ids=[b[0] for b in BAD])
def test_ingest_frame_refuses_what_the_plain_path_refuses(
    what: str, changes: dict[str, Any], message: str
) -> None:
    first, nxt = _next_call_fields()
    bad = {**nxt, "input_delta": dict(nxt["input_delta"])}
    for key, value in changes.items():
        if key.startswith("input_delta."):
            bad["input_delta"][key.split(".", 1)[1]] = value
        else:
            bad[key] = value
    frame = msgspec.msgpack.encode(bad)
    plain, fast = Forest(), Forest()
    plain.add_frame(msgspec.msgpack.encode(first))
    fast.ingest_frame(msgspec.msgpack.encode(first))
    tree = fast.trees["e"]
    before = (tree.n, tree.ids.copy(), dict(tree.calls), tree.stats.calls, tree.policy_tokens)
    with pytest.raises(RecordError, match=message) as plain_err:
        plain.add_frame(frame, name="msg 1")
    with pytest.raises(RecordError, match=message) as fast_err:
        fast.ingest_frame(frame, name="msg 1")
    assert str(fast_err.value) == str(plain_err.value)
    assert fast.trees.keys() == plain.trees.keys()
    assert (tree.n, tree.stats.calls, tree.policy_tokens) == (before[0], before[3], before[4])
    assert np.array_equal(tree.ids, before[1]) and tree.calls == before[2]
    # The good record still goes in after the refused one, through the bytes path.
    info = fast.ingest_frame(msgspec.msgpack.encode(nxt))
    assert isinstance(info, CallInfo) and info.call_id == "c1"
    plain.add_frame(msgspec.msgpack.encode(nxt))
    _same_tree(tree, plain.trees["e"])


def test_ingest_frame_takes_what_only_the_full_decoder_reads() -> None:
    """Arrays sent in another encoding (ids as a msgpack list, logprobs as float64 bytes) are not the
    bytes path's: the full decoder reads them, and the tree is the same."""
    first, nxt = _next_call_fields()
    nxt = {
        **nxt,
        "output_ids": [4002, 4003],
        "output_logprobs": msgspec.msgpack.Ext(4, np.array([-0.2, -0.3]).tobytes()),
    }
    frames = [msgspec.msgpack.encode(first), msgspec.msgpack.encode(nxt)]
    fast = Forest()
    for f in frames:
        fast.ingest_frame(f)
    _same_tree(fast.trees["e"], _plain(frames).trees["e"])
    assert fast.trees["e"].call_sequence("c1")[1].tolist() == ids(OUT, 2, 3)


def test_ingest_frame_takes_scores_and_refuses_bytes_that_do_not_decode() -> None:
    forest = Forest()
    score = Score(execution_id="e", group_id="g", value=1.0)
    assert forest.ingest_frame(CODEC.encode_msgpack(score)) == score
    with pytest.raises(RecordError, match=r"^msg 7: "):
        forest.ingest_frame(b"\x93\x01", name="msg 7")
    first, _ = _next_call_fields()
    forest.ingest_frame(msgspec.msgpack.encode(first))
    assert forest.trees["e"].score == score


def test_ingest_frame_refuses_a_call_id_it_has() -> None:
    first, nxt = _next_call_fields()
    forest = Forest()
    forest.ingest_frame(msgspec.msgpack.encode(first))
    forest.ingest_frame(msgspec.msgpack.encode(nxt))
    tree = forest.trees["e"]
    n, calls = tree.n, dict(tree.calls)
    with pytest.raises(RecordError, match=r"call='c1'.*duplicate call id"):
        forest.ingest_frame(msgspec.msgpack.encode(nxt))
    assert tree.n == n and tree.calls == calls


@pytest.mark.parametrize("first_tokens", [0, 1])
def test_ingest_frame_after_a_call_with_no_tokens(first_tokens: int) -> None:
    """A call whose parent carried no tokens at all (it ends at the root) starts the tree's first run,
    or a new branch at the root, as the plain path makes it."""
    calls = [call("c0", ids(SYS, 1)[:first_tokens], [])]
    if first_tokens:
        calls.append(call("c1", [], [], agent="sub"))
    parent = calls[-1].call_id
    calls.append(call("c2", None, ids(OUT, 1), agent="sub", delta=(parent, 0, ids(SYS, 7))))
    calls.append(call("c3", None, ids(OUT, 2), agent="sub", delta=("c2", 2, ids(TOOL, 1))))
    frames = [CODEC.encode_msgpack(c) for c in calls]
    fast = Forest()
    for f in frames:
        fast.ingest_frame(f)
    _same_tree(fast.trees["e"], _plain(frames).trees["e"])
    assert fast.trees["e"].call_sequence("c3")[0].tolist() == [*ids(SYS, 7), *ids(OUT, 1), *ids(TOOL, 1)]


def test_ingest_frame_a_next_call_with_no_tokens_below_a_parent_inside_the_arena() -> None:
    """An agent's next call that carries no tokens, its parent's last token inside the arena (another
    agent's call came after it): it ends where its parent does, as the plain path places it."""
    calls = [
        call("c0", PROMPT, ids(OUT, 1)),
        call("c1", ids(SYS, 7), ids(OUT, 5), agent="sub"),
        call("c2", None, [], delta=("c0", 4, [])),
        call("c3", None, ids(OUT, 2), delta=("c2", 4, ids(TOOL, 1))),
    ]
    frames = [CODEC.encode_msgpack(c) for c in calls]
    fast = Forest()
    infos = [fast.ingest_frame(f) for f in frames]
    _same_tree(fast.trees["e"], _plain(frames).trees["e"])
    assert isinstance(infos[2], CallInfo) and infos[2].end == fast.trees["e"].calls["c0"].end


def test_every_well_formed_call_takes_the_view_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not only an agent's next call: each agent's first call, retries, calls after a compaction and
    calls that drift are merged from the message's `CallView` too (`ExecutionTree.merge_view`), no
    `Call` decoded, and the tree is the plain path's."""
    cfg = SynthConfig(
        main_calls=30, max_context=5_000, subagents=2, subagent_compactions=1, retries=3, drifts=2, seed=3
    )
    calls = synth_execution(cfg, "e")
    frames = [CODEC.encode_msgpack(c) for c in calls]
    plain = _plain(frames)

    def refuse(data: Any, name: str = "<frame>") -> Any:
        raise AssertionError(f"{name}: decoded in full")

    monkeypatch.setattr("gyre_traj.tree.decode_msgpack_record", refuse)
    fast = Forest()
    for c, f in zip(calls, frames, strict=True):
        assert fast.ingest_frame(f) == plain.trees["e"].calls[c.call_id]
    _same_tree(fast.trees["e"], plain.trees["e"])
    assert plain.trees["e"].stats.drifts  # the drifting calls were among them


@pytest.mark.parametrize(
    ("what", "changes", "message"),
    [
        ("negative input id", {"input_ids": _ids(1001, -3)}, r"input ids contain a negative id -3"),
        ("positive logprob", {"output_logprobs": _lps(0.5)}, r"logprobs must be <= 0"),
        ("empty execution id", {"execution_id": ""}, r"execution_id and call_id must be non-empty"),
    ],
)
def test_a_refused_first_call_leaves_the_forest_as_the_plain_path_does(
    what: str, changes: dict[str, Any], message: str
) -> None:
    """An execution's first call that its new tree refuses: the same error, and the same trees and
    pending scores after it (the tree registered, the score it waited for handed to it)."""
    first, _ = _next_call_fields()
    frame = msgspec.msgpack.encode({**first, **changes})
    score = CODEC.encode_msgpack(Score(execution_id="e", group_id="g", value=1.0))
    plain, fast = Forest(), Forest()
    plain.add_frame(score)
    fast.ingest_frame(score)
    with pytest.raises(RecordError, match=message) as plain_err:
        plain.add_frame(frame, name="msg 1")
    with pytest.raises(RecordError, match=message) as fast_err:
        fast.ingest_frame(frame, name="msg 1")
    assert str(fast_err.value) == str(plain_err.value)
    assert fast.trees.keys() == plain.trees.keys() and fast.pending_scores == plain.pending_scores
    assert [(t.score, t.n, t.calls) for t in fast] == [(t.score, t.n, t.calls) for t in plain]


def test_ingest_call_takes_calls_and_refuses_any_other_record() -> None:
    """`Forest.ingest_call` (a service's PULL of call records): a call as `ingest_frame` takes it; a
    score or a call batch is a RecordError and nothing is added; a call sent twice is a RecordError
    the second time, and `booked` says it is in its tree."""
    c0 = call("c0", PROMPT, ids(OUT, 1))
    c1 = call("c1", None, ids(OUT, 2), delta=("c0", 4, ids(TOOL, 1)))
    forest, reference = Forest(), Forest()
    for c in (c0, c1):
        assert forest.ingest_call(CODEC.encode_msgpack(c)) == reference.ingest_frame(CODEC.encode_msgpack(c))
    _same_tree(forest.trees["e"], reference.trees["e"])
    score = CODEC.encode_msgpack(Score(execution_id="e2", group_id="g", value=1.0))
    with pytest.raises(RecordError, match="a Score record, not a call"):
        forest.ingest_call(score, name="msg 3")
    batch = CODEC.encode_msgpack(CallBatch.of([call("b0", PROMPT, ids(OUT, 3), execution="e3")]))
    with pytest.raises(RecordError, match="a CallBatch record, not a call"):
        forest.ingest_call(batch)
    assert forest.pending_scores == {} and set(forest.trees) == {"e"}
    with pytest.raises(RecordError, match="duplicate call id"):
        forest.ingest_call(CODEC.encode_msgpack(c1))
    assert forest.booked("e", "c1") and not forest.booked("e", "c2") and not forest.booked("e2", "c1")
    _same_tree(forest.trees["e"], reference.trees["e"])
