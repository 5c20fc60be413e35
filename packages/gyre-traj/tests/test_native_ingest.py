"""The live ingest path's native half (`gyre_traj.native`, the C extension `gyre_traj._ingest`) against
its pure-Python path: for any message (an agent's next call, or any other call it merges: a full input,
a retry, a call after a compaction, a branch with drift), well formed or not (fields reordered, left out, added, repeated,
of another type or out of range; arrays in another encoding, negative ids, NaN logprobs; bytes flipped,
cut or inserted), `Forest.ingest_frame` gives the same CallInfo or raises the same error with and
without it, and leaves the same trees. Also: the native half is taken for an agent's next call and
for the calls it merges (all but the ones whose output repeats tokens already in the tree), and gyre-traj
works without the extension (`GYRE_TRAJ_NATIVE=0`, as an install without a C compiler)."""

from __future__ import annotations

import math
import os
import shutil
import struct
import subprocess
import sys
import sysconfig
from typing import Any

import msgspec
import numpy as np
import pytest
from gyre_traj import native
from gyre_traj.io import Codec
from gyre_traj.records import MAX_WEIGHT_VERSION, Role, Score
from gyre_traj.synth import SynthConfig, synth_execution
from gyre_traj.tree import CallInfo, ExecutionTree, Forest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .helpers import OUT, SYS, TOOL, USER, call, ids

needs_native = pytest.mark.skipif(not native.BUILT, reason="gyre_traj._ingest is not built here")

CODEC = Codec()
ARRAYS = ("ids", "parent", "depth", "policy", "logprob", "version")
Ext = msgspec.msgpack.Ext


# ------------------------------------------------------------------------------------- raw msgpack


class Raw:
    """Bytes put into a message as they are (a value in an encoding msgspec does not write, or not
    msgpack at all)."""

    def __init__(self, data: bytes) -> None:
        self.data = data


class Pairs:
    """A msgpack map written pair by pair, in this order, repeated keys included."""

    def __init__(self, pairs: list[tuple[Any, Any]], header: str = "short") -> None:
        self.pairs = pairs
        self.header = header


def enc(value: Any) -> bytes:
    """`value` as msgpack; `Raw` as it is, `Pairs` as a map in its order (with a fixmap, map16 or
    map32 header)."""
    if isinstance(value, Raw):
        return value.data
    if isinstance(value, Pairs):
        n = len(value.pairs)
        if value.header == "map32":
            head = b"\xdf" + struct.pack(">I", n)
        elif value.header == "map16" or n > 15:
            head = b"\xde" + struct.pack(">H", n)
        else:
            head = bytes([0x80 | n])
        return head + b"".join(enc(k) + enc(v) for k, v in value.pairs)
    return msgspec.msgpack.encode(value)


def ids_ext(*xs: int) -> Ext:
    return Ext(1, np.array(xs, "<i4").tobytes())


def lps_ext(*xs: float) -> Ext:
    return Ext(2, np.array(xs, "<f4").tobytes())


# ------------------------------------------------------------------------------------ the scenario

PROMPT = ids(SYS, 1, 2) + ids(USER, 1)


def _prefix() -> list[bytes]:
    """An execution's first calls: the main agent's first call c0 and its next call c1, then a
    sub-agent's first call s0, so that c1 ends inside the arena and s0 at its end."""
    calls = [
        call("c0", PROMPT, ids(OUT, 1)),
        call("c1", None, ids(OUT, 2, 3), delta=("c0", 4, ids(TOOL, 1))),
        call("s0", ids(SYS, 7), ids(OUT, 5), agent="sub"),
    ]
    return [CODEC.encode_msgpack(c) for c in calls]


def _next_fields(parent: str = "s0", keep: int = 2) -> list[tuple[Any, Any]]:
    """The sub-agent's next call (parent s0 ends at the arena's last token), as msgspec writes it."""
    return [
        ("kind", "call"),
        ("execution_id", "e"),
        ("call_id", "s1"),
        ("agent_id", "sub"),
        ("role", "subagent"),
        ("output_ids", ids_ext(4011, 4012)),
        ("output_logprobs", lps_ext(-0.5, -0.25)),
        ("weight_version", 3),
        ("finish_reason", "length"),
        ("input_delta", Pairs([("parent", parent), ("keep", keep), ("append", ids_ext(3001, 3002, 3003))])),
        ("t_start", 1.5),
        ("t_end", 2.5),
        ("v", 1),
        ("metadata", {"extends": parent, "engines": "e0"}),
    ]


def _run(frames: list[bytes], use_native: bool) -> tuple[Forest, list[Any]]:
    """Each frame through `ingest_frame`, the native half in use or not: the forest and each outcome
    (the CallInfo or record, or the error's type and text: a RecordError, or anything else)."""
    forest = Forest()
    out: list[Any] = []
    with native.use_native(use_native):
        for k, frame in enumerate(frames):
            try:
                out.append(forest.ingest_frame(frame, name=f"msg {k}"))
            except Exception as exc:
                out.append((type(exc).__name__, str(exc)))
    return forest, out


def _same_forests(a: Forest, b: Forest) -> None:
    assert a.trees.keys() == b.trees.keys()
    assert a.pending_scores == b.pending_scores
    for eid, ta in a.trees.items():
        tb = b.trees[eid]
        for name in ARRAYS:
            assert np.array_equal(getattr(ta, name), getattr(tb, name)), name
        assert ta.calls == tb.calls and ta.order == tb.order and ta.stats == tb.stats
        assert ta.n == tb.n and ta.policy_tokens == tb.policy_tokens and ta.score == tb.score
        for cid in ta.order:
            got_a, got_b = ta.call_sequence(cid), tb.call_sequence(cid)
            assert all(np.array_equal(x, y) for x, y in zip(got_a, got_b, strict=True)), cid


def _follow_up() -> list[bytes]:
    """Well-formed calls after the message under test, so that a difference it left in the tree's
    state shows: the sub-agent's next call (if the message under test was not taken), and the main
    agent's next call (its parent c1 now inside the arena)."""
    return [
        enc(Pairs(_next_fields())),
        enc(
            Pairs(
                [
                    *[(k, v) for k, v in _next_fields("c1", 7) if k not in ("call_id", "agent_id", "role")],
                    ("call_id", "c2"),
                    ("agent_id", "main"),
                    ("role", "main"),
                ]
            )
        ),
    ]


def _check(message: bytes) -> tuple[Any, Any]:
    """`message` after the prefix and before the follow-up, with and without the native half: the same
    outcome for every message and the same forests after each. Returns the message's outcomes."""
    frames = [*_prefix(), message, *_follow_up()]
    fast, out_fast = _run(frames, True)
    slow, out_slow = _run(frames, False)
    assert out_fast == out_slow
    _same_forests(fast, slow)
    k = len(_prefix())
    return out_fast[k], out_slow[k]


# ---------------------------------------------------------------------------------- the checks


@needs_native
def test_the_native_half_takes_an_agents_next_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent's next call (its parent ending at the arena's last token, or inside the arena with
    nothing below it) goes in through the native half: no msgspec decode, no `extend_next`."""
    frames = _prefix()
    forest, _ = _run(frames, True)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the Python path was taken")

    for name in ("extend_next", "merge_view", "add"):
        monkeypatch.setattr(ExecutionTree, name, refuse)
    monkeypatch.setattr("gyre_traj.tree.decode_msgpack_record", refuse)
    monkeypatch.setattr(Forest, "read_view", refuse)
    with native.use_native(True):
        for frame in _follow_up():  # s1: parent at the arena's end; c2: parent inside the arena
            info = forest.ingest_frame(frame)
            assert isinstance(info, CallInfo)
    monkeypatch.undo()
    slow, _ = _run([*frames, *_follow_up()], False)
    _same_forests(forest, slow)
    assert forest.trees["e"].calls["c2"].n_input == 10


@needs_native
def test_a_whole_execution_takes_the_native_half_for_most_calls() -> None:
    """The synthetic execution's calls through both paths: the same trees; and its agents' next calls
    are taken by the native half (`native.extend_next` returns their CallInfo)."""
    calls = synth_execution(
        SynthConfig(main_calls=60, max_context=8_000, subagents=3, retries=3, drifts=2, seed=5), "e"
    )
    frames = [CODEC.encode_msgpack(c) for c in calls]
    fast, out_fast = _run(frames, True)
    slow, out_slow = _run(frames, False)
    assert out_fast == out_slow
    _same_forests(fast, slow)
    taken, forest = 0, Forest()
    assert native.extend_next is not None
    for frame in frames:
        if native.extend_next(frame, forest.trees) is not None:
            taken += 1
        else:
            forest.ingest_frame(frame)
    _same_forests(forest, slow)
    assert taken >= len(frames) * 3 // 4


@needs_native
def test_the_native_half_merges_first_calls_retries_compactions_and_branches() -> None:
    """Calls that are not an agent's next call are merged by the native half too (a CallInfo, not
    None), as the Python path merges them: a sub-agent's first call sharing the system prompt, a retry
    of a call whose continuation is already in the tree, a compaction cutting its parent early, a
    branch that drifts from the parent's output. One whose output repeats the tree's tokens (they
    become policy tokens) is left to Python."""
    frames = [
        *_prefix(),
        # a sub-agent's first call: a full input sharing SYS 1 with the main agent's, then its own
        CODEC.encode_msgpack(call("s9", ids(SYS, 1, 9), ids(OUT, 8), agent="sub2", role=Role.SUBAGENT)),
        # a retry of c1 (the same parent and cut, another continuation)
        CODEC.encode_msgpack(call("r1", None, ids(OUT, 6), delta=("c0", 4, ids(TOOL, 1, 2)))),
        # a compaction: keeps 2 tokens of c1, a summary after them
        CODEC.encode_msgpack(
            call("m1", None, ids(OUT, 9), delta=("c1", 2, ids(USER, 5)), role=Role.MAIN_SUMMARY)
        ),
        # a branch cutting c1 inside its output (drift: the policy said OUT 3 there)
        CODEC.encode_msgpack(call("d1", None, ids(OUT, 7), delta=("c1", 6, ids(TOOL, 4)))),
        # no new input, an output already in the tree after c0's input: left to Python (promotion)
        CODEC.encode_msgpack(call("p1", None, ids(TOOL, 1), delta=("c0", 4, []))),
    ]
    slow, out_slow = _run(frames, False)
    forest, out = Forest(), []
    assert native.extend_next is not None
    taken = []
    for frame in frames:
        info = native.extend_next(frame, forest.trees)
        taken.append(info is not None)
        out.append(info if info is not None else forest.ingest_frame(frame))
    assert out == out_slow
    _same_forests(forest, slow)
    assert taken == [False, True, True, True, True, True, True, False]
    t = forest.trees["e"]
    assert [d.call_id for d in t.stats.drifts] == ["d1"] and t.stats.context_promoted == 1


@st.composite
def tree_calls(draw: st.DrawFn) -> list[bytes]:
    """Calls of one execution, each a full input or a delta cutting an earlier call anywhere (its length
    or past it included), their tokens from a small alphabet so that they often follow the tree's
    (retries, shared prefixes, outputs repeating tokens: promotions, drift), now and then a negative
    id, a logprob above 1e-4 or a NaN, or a call id used twice."""
    n_calls = draw(st.integers(2, 12))
    tok = st.integers(1, 4) | st.sampled_from([-3, 7])
    lengths: dict[str, int] = {}
    frames = []
    for k in range(n_calls):
        cid = f"c{draw(st.integers(0, k))}" if draw(st.integers(0, 9)) == 0 else f"c{k}"
        out = draw(st.lists(tok, max_size=5))
        lps = [
            draw(
                st.sampled_from([-0.5, -1.0, -0.25, 0.5, math.nan])
                if draw(st.integers(0, 15)) == 0
                else st.just(-0.5)
            )
            for _ in out
        ]
        fields: dict[str, Any] = {
            "kind": "call",
            "execution_id": "e",
            "call_id": cid,
            "agent_id": draw(st.sampled_from(["main", "sub"])),
            "role": draw(st.sampled_from(["main", "subagent", "main_summary"])),
            "output_ids": ids_ext(*out),
            "output_logprobs": lps_ext(*lps),
            "weight_version": draw(st.integers(0, 3)),
        }
        if not lengths or draw(st.integers(0, 3)) == 0:
            inp = draw(st.lists(tok, max_size=8))
            fields["input_ids"] = ids_ext(*inp)
            n_in = len(inp)
        else:
            parent = draw(st.sampled_from(sorted(lengths)))
            keep = draw(st.integers(0, lengths[parent] + 1))
            rest = draw(st.lists(tok, max_size=6))
            fields["input_delta"] = {"parent": parent, "keep": keep, "append": ids_ext(*rest)}
            n_in = keep + len(rest)
        lengths.setdefault(cid, n_in + len(out))
        frames.append(enc(fields))
    return frames


@needs_native
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames=tree_calls())
def test_any_sequence_of_calls_gives_the_same_outcomes_and_trees(frames: list[bytes]) -> None:
    fast, out_fast = _run(frames, True)
    slow, out_slow = _run(frames, False)
    assert out_fast == out_slow
    _same_forests(fast, slow)


@needs_native
def test_stats_read_through_the_tree_count_every_call() -> None:
    frames = [*_prefix(), *_follow_up()]
    fast, _ = _run(frames, True)
    tree = fast.trees["e"]
    assert (tree.stats.calls, tree.stats.delta_calls) == (5, 3)
    assert tree.stats.call_tokens == sum(info.length for info in tree.calls.values())


@needs_native
def test_a_memoryview_message_and_a_view_given() -> None:
    """The message as a memoryview (not bytes), and with the view the service read first."""
    frames = [*_prefix(), *_follow_up()]
    forest = Forest()
    with native.use_native(True):
        for frame in frames:
            forest.ingest_frame(memoryview(frame), view=forest.read_view(frame))
    slow, _ = _run(frames, False)
    _same_forests(forest, slow)


WEIRD_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2,
    2**31 - 1,
    2**31,
    2**63 - 1,
    2**64 - 1,
    -(2**63),
    0.0,
    -0.0,
    1.5,
    math.nan,
    math.inf,
    -math.inf,
    "",
    "e",
    "s0",
    "s1",
    "c0",
    "c1",
    "main",
    "subagent",
    "call",
    "score",
    "é",
    "\U0001f600",
    b"\x00\x01\x02\x03",
    [],
    [1, 2],
    {},
    {"a": "b"},
    {"a": 1},
    Ext(1, b""),
    Ext(1, b"\x01\x00\x00\x00"),
    Ext(1, b"\x01\x00\x00"),
    Ext(2, b"\x00\x00\x00\xbf"),
    Ext(3, b"\x00" * 8),
    Ext(4, b"\x00" * 8),
    Ext(-1, b"\x00" * 4),
    Raw(b"\xca\x3f\xc0\x00\x00"),  # float32 1.5
    Raw(b"\xca\x7f\xc0\x00\x00"),  # float32 NaN
    Raw(b"\xd3" + struct.pack(">q", 3)),  # int64 3
    Raw(b"\xcf" + struct.pack(">Q", 2)),  # uint64 2
    Raw(b"\xd0\xff"),  # int8 -1
    Raw(b"\xd9\x01e"),  # str8 "e"
    Raw(b"\xda\x00\x04main"),  # str16 "main"
    Raw(b"\xa2\xff\xfe"),  # invalid UTF-8
    Raw(b"\xa3\xed\xa0\x80"),  # an encoded surrogate
    Raw(b"\xc4\x01e"),  # bin "e"
    Raw(b"\xc1"),  # never used
]

FIELDS = [name for name, _ in _next_fields()]
id_values = st.one_of(st.integers(0, 2**31 - 1), st.integers(-(2**31), -1), st.sampled_from([0, 1, 4000]))
logprob_values = st.one_of(
    st.floats(width=32, allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-4, 1.0000001e-4, 9.9999e-5, -1e-30, math.nan, -math.nan, -math.inf]),
)


@st.composite
def messages(draw: st.DrawFn) -> bytes:
    """A message from the sub-agent's next call, its fields mutated."""
    parents = [("s0", 2)] * 6 + [("c1", 7), ("c0", 4), ("s1", 2), ("x", 2), ("s0", 1), ("s0", 3), ("s0", -1)]
    pairs = list(_next_fields(*draw(st.sampled_from(parents))))  # (mostly one it can take as it is)
    for _ in range(draw(st.sampled_from([0, 1, 1, 1, 2, 3]))):
        kind = draw(st.integers(0, 9))
        if kind == 0 and pairs:  # leave one out
            pairs.pop(draw(st.integers(0, len(pairs) - 1)))
        elif kind == 1:  # an unknown key, or a known one again
            key = draw(st.sampled_from([*FIELDS, "colour", "Kind", ""]))
            pairs.insert(draw(st.integers(0, len(pairs))), (key, draw(st.sampled_from(WEIRD_VALUES))))
        elif kind == 2 and pairs:  # another value
            k = draw(st.integers(0, len(pairs) - 1))
            pairs[k] = (pairs[k][0], draw(st.sampled_from(WEIRD_VALUES)))
        elif kind == 3:  # other ids
            key = draw(st.sampled_from(["output_ids", "append"]))
            arr = draw(st.lists(id_values, max_size=6))
            _set(pairs, key, ids_ext(*arr))
        elif kind == 4:  # other logprobs (one per output id, or not)
            arr = draw(st.lists(logprob_values, max_size=4))
            _set(pairs, "output_logprobs", lps_ext(*arr))
        elif kind == 5:  # a weight version, schema version or timestamp at a boundary
            key = draw(st.sampled_from(["weight_version", "v", "t_start", "t_end"]))
            value = draw(
                st.sampled_from(
                    [
                        MAX_WEIGHT_VERSION,
                        MAX_WEIGHT_VERSION + 1,
                        -1,
                        0,
                        1,
                        2,
                        -5,
                        2**53,
                        2**53 + 1,
                        -(2**53) - 1,
                    ]
                )
            )
            _set(pairs, key, value)
        elif kind == 6:  # the delta's fields
            delta = [("parent", "s0"), ("keep", 2), ("append", ids_ext(3001))]
            delta = draw(st.permutations(delta))
            if draw(st.booleans()):
                delta.append(draw(st.sampled_from([("keep", 2), ("extra", 1), ("parent", "s0")])))
            if draw(st.booleans()):
                delta.pop(draw(st.integers(0, len(delta) - 1)))
            _set(pairs, "input_delta", Pairs(delta, draw(st.sampled_from(["short", "map16", "map32"]))))
        elif kind == 7:  # metadata
            _set(
                pairs,
                "metadata",
                draw(
                    st.sampled_from(
                        [
                            {},
                            {"k": "v"},
                            Pairs([("k", "v"), ("k", "w")]),
                            Pairs([("k", 1)]),
                            Pairs([(Raw(b"\xa1\xff"), "v")]),
                            Pairs([("k", Raw(b"\xa2\xc3\xa9"))]),
                            None,
                            [],
                        ]
                    )
                ),
            )
        elif kind == 8:  # an input in full besides (or instead of) the delta
            _set(pairs, "input_ids", draw(st.sampled_from([None, ids_ext(1001), [1001]])))
        else:  # the role, finish reason, ids of the call and its execution
            key = draw(
                st.sampled_from(["role", "finish_reason", "call_id", "execution_id", "agent_id", "kind"])
            )
            _set(pairs, key, draw(st.sampled_from(WEIRD_VALUES)))
    if draw(st.booleans()):
        pairs = draw(st.permutations(pairs))
    return enc(Pairs(pairs, draw(st.sampled_from(["short", "map16", "map32"]))))


def _set(pairs: list[tuple[Any, Any]], key: str, value: Any) -> None:
    """Set `key` in the call's map, or in its delta's for `append` (which it makes a plain map)."""
    if key == "append":
        for k, (name, delta) in enumerate(pairs):
            if name == "input_delta" and isinstance(delta, Pairs):
                items = [(n, v) for n, v in delta.pairs if n != "append"] + [("append", value)]
                pairs[k] = (name, Pairs(items))
        return
    for k, (name, _) in enumerate(pairs):
        if name == key:
            pairs[k] = (key, value)
            return
    pairs.append((key, value))


def _int_encodings(v: int) -> list[Any]:
    """`v` in each msgpack integer encoding that holds it."""
    out: list[Any] = [v]
    for code, fmt, lo, hi in (
        (b"\xd0", ">b", -(2**7), 2**7 - 1),
        (b"\xd1", ">h", -(2**15), 2**15 - 1),
        (b"\xd2", ">i", -(2**31), 2**31 - 1),
        (b"\xd3", ">q", -(2**63), 2**63 - 1),
        (b"\xcc", ">B", 0, 2**8 - 1),
        (b"\xcd", ">H", 0, 2**16 - 1),
        (b"\xce", ">I", 0, 2**32 - 1),
        (b"\xcf", ">Q", 0, 2**64 - 1),
    ):
        if lo <= v <= hi:
            out.append(Raw(code + struct.pack(fmt, v)))
    return out


def _str_encodings(v: str) -> list[Any]:
    """`v` as fixstr (when short), str8, str16 and str32."""
    b = v.encode()
    out: list[Any] = [v]
    if len(b) < 256:
        out.append(Raw(b"\xd9" + bytes([len(b)]) + b))
    return [*out, Raw(b"\xda" + struct.pack(">H", len(b)) + b), Raw(b"\xdb" + struct.pack(">I", len(b)) + b)]


def _float_encodings(v: float) -> list[Any]:
    """`v` as float64, as float32 when that holds it exactly, and as an integer when it is one."""
    out: list[Any] = [v]
    try:
        as32 = struct.pack(">f", v)
    except OverflowError:  # beyond float32
        as32 = b""
    if as32 and (math.isnan(v) or struct.unpack(">f", as32)[0] == v):
        out.append(Raw(b"\xca" + as32))
    if math.isfinite(v) and v == int(v) and abs(v) < 2**63:
        out.extend(_int_encodings(int(v)))
    return out


def _ext_encodings(e: Ext) -> list[Any]:
    """An extension value as msgspec writes it, and in the wider ext8/16/32 headers."""
    n = len(e.data)
    code = struct.pack(">b", e.code)
    out: list[Any] = [e, Raw(b"\xc8" + struct.pack(">H", n) + code + e.data)]
    out.append(Raw(b"\xc9" + struct.pack(">I", n) + code + e.data))
    if n < 256:
        out.append(Raw(b"\xc7" + bytes([n]) + code + e.data))
    return out


@st.composite
def next_calls(draw: st.DrawFn) -> bytes:
    """The sub-agent's next call as any writer may send it: keys in any order, optional fields left
    out, each value in any encoding msgpack has for it, ids and logprobs of any value (negative, NaN,
    beyond 1e-4 included), timestamps and versions at their boundaries."""
    n_out = draw(st.integers(0, 5))
    append = ids_ext(*draw(st.lists(id_values, max_size=5)))
    out = ids_ext(*draw(st.lists(id_values, min_size=n_out, max_size=n_out)))
    lps = lps_ext(*draw(st.lists(logprob_values, min_size=n_out, max_size=n_out)))
    times = st.one_of(st.floats(allow_nan=True), st.integers(-(2**60), 2**60))
    pick = draw
    delta = [
        ("parent", pick(st.sampled_from(_str_encodings("s0")))),
        ("keep", pick(st.sampled_from(_int_encodings(2)))),
        ("append", pick(st.sampled_from(_ext_encodings(append)))),
    ]
    values: dict[str, Any] = {
        "kind": pick(st.sampled_from(_str_encodings("call"))),
        "execution_id": pick(st.sampled_from(_str_encodings("e"))),
        "call_id": pick(st.sampled_from(_str_encodings(pick(st.sampled_from(["s1", "s9", "é😀"]))))),
        "agent_id": pick(st.sampled_from(_str_encodings(pick(st.sampled_from(["sub", "", "x" * 300]))))),
        "role": pick(
            st.sampled_from(_str_encodings(pick(st.sampled_from(["subagent", "main", "main_summary"]))))
        ),
        "output_ids": pick(st.sampled_from(_ext_encodings(out))),
        "output_logprobs": pick(st.sampled_from(_ext_encodings(lps))),
        "weight_version": pick(
            st.sampled_from(_int_encodings(pick(st.sampled_from([0, 7, MAX_WEIGHT_VERSION, 2**31, -1]))))
        ),
        "finish_reason": pick(st.sampled_from(_str_encodings(pick(st.sampled_from(["stop", "length", ""]))))),
        "input_delta": Pairs(
            pick(st.permutations(delta)), pick(st.sampled_from(["short", "map16", "map32"]))
        ),
        "input_ids": None,
        "t_start": pick(st.sampled_from(_float_encodings(pick(times) * 1.0))),
        "t_end": pick(st.sampled_from(_float_encodings(float(pick(times))))),
        "v": pick(st.sampled_from(_int_encodings(pick(st.sampled_from([1, 0, -3, 2]))))),
        "metadata": Pairs(
            [
                (k, pick(st.sampled_from(_str_encodings(v))))
                for k, v in (("extends", "s0"), ("engines", "e0,e1"))
            ]
        ),
    }
    optional = ["kind", "finish_reason", "input_ids", "t_start", "t_end", "v", "metadata"]
    left_out = pick(st.sets(st.sampled_from(optional)))
    pairs = [(k, v) for k, v in values.items() if k not in left_out]
    return enc(Pairs(pick(st.permutations(pairs)), pick(st.sampled_from(["short", "map16", "map32"]))))


@needs_native
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(message=next_calls())
def test_any_encoding_of_a_next_call_gives_the_same_outcome(message: bytes) -> None:
    _check(message)


@needs_native
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(message=messages())
def test_mutated_fields_give_the_same_outcome(message: bytes) -> None:
    _check(message)


@needs_native
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_mutated_bytes_give_the_same_outcome(data: st.DataObject) -> None:
    """Byte flips, cuts and insertions anywhere in a well-formed next call's message."""
    raw = bytearray(enc(Pairs(_next_fields())))
    for _ in range(data.draw(st.integers(1, 3))):
        op = data.draw(st.integers(0, 3))
        at = data.draw(st.integers(0, len(raw)))
        if op == 0 and at < len(raw):
            raw[at] = data.draw(st.integers(0, 255))
        elif op == 1 and at < len(raw):
            raw[at] ^= 1 << data.draw(st.integers(0, 7))
        elif op == 2:
            del raw[at:]
        else:
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=4))
    _check(bytes(raw))


@needs_native
@pytest.mark.parametrize(
    ("what", "changes", "taken"),
    [
        ("as sent", {}, True),
        ("keys reordered", "reverse", True),
        ("optional fields left out", ["finish_reason", "t_start", "t_end", "v", "metadata"], True),
        ("kind left out (CallView takes it, the native half does not)", ["kind"], True),
        ("float32 timestamps", {"t_start": Raw(b"\xca\x3f\xc0\x00\x00")}, True),
        ("integer timestamps", {"t_start": 3, "t_end": -4}, True),
        ("an input in full, nil", {"input_ids": None}, True),
        ("an older schema", {"v": 0}, True),
        ("the highest weight version", {"weight_version": MAX_WEIGHT_VERSION}, True),
        ("a logprob of 1e-4", {"output_logprobs": lps_ext(1e-4, -0.0)}, True),
        ("no output", {"output_ids": ids_ext(), "output_logprobs": lps_ext()}, True),
        ("a logprob above 1e-4", {"output_logprobs": lps_ext(1.0001e-4, -1.0)}, False),
        ("a NaN logprob", {"output_logprobs": lps_ext(-1.0, math.nan)}, False),
        ("a negative output id", {"output_ids": ids_ext(4011, -2)}, False),
        ("a weight version beyond int32", {"weight_version": MAX_WEIGHT_VERSION + 1}, False),
        ("a NaN timestamp", {"t_end": math.nan}, False),
        ("a newer schema", {"v": 2}, False),
        ("an unknown role", {"role": "boss"}, False),
        ("an unknown field", {"colour": "red"}, False),
        ("metadata not str to str", {"metadata": {"k": 1}}, False),
        ("ids as a list (the full decoder reads them)", {"output_ids": [4011, 4012]}, True),
        (
            "logprobs as float64 (read in full)",
            {"output_logprobs": Ext(4, np.array([-0.5, -0.25]).tobytes())},
            True,
        ),
    ],
)
def test_one_change_at_a_time(what: str, changes: Any, taken: bool) -> None:
    """Each change alone: the same outcome with and without the native half, and whether the call is
    taken (a CallInfo) or refused (an error)."""
    pairs = _next_fields()
    if changes == "reverse":
        pairs.reverse()
    elif isinstance(changes, list):
        pairs = [(k, v) for k, v in pairs if k not in changes]
    else:
        for key, value in changes.items():
            _set(pairs, key, value)
    fast, _ = _check(enc(Pairs(pairs)))
    assert isinstance(fast, CallInfo) == taken, fast


@needs_native
def test_scores_and_other_records_pass_through() -> None:
    score = CODEC.encode_msgpack(Score(execution_id="e", group_id="g", value=1.0))
    frames = [score, *_prefix(), b"\x93\x01", b"", *_follow_up()]
    fast, out_fast = _run(frames, True)
    slow, out_slow = _run(frames, False)
    assert out_fast == out_slow
    _same_forests(fast, slow)


def test_without_the_extension() -> None:
    """`GYRE_TRAJ_NATIVE=0` leaves the extension unimported (as an install without a C compiler): the
    pure-Python base class, the live path in Python, the same tree."""
    code = (
        "from gyre_traj import native\n"
        "from gyre_traj.io import Codec\n"
        "from gyre_traj.synth import SynthConfig, synth_execution\n"
        "from gyre_traj.tree import ExecutionTree, Forest\n"
        "assert not native.BUILT and not native.in_use(), 'the extension was imported'\n"
        "assert ExecutionTree.__mro__[1] is native.PyTreeState\n"
        "c = Codec(); f = Forest()\n"
        "for x in synth_execution(SynthConfig(main_calls=30, max_context=4000, subagents=2, seed=9), 'e'):\n"
        "    f.ingest_frame(c.encode_msgpack(x))\n"
        "t = f.trees['e']\n"
        "print(t.n, t.policy_tokens, t.stats.calls, int(t.ids.sum()), float(t.logprob.sum()))\n"
    )
    env = {**os.environ, native.ENV: "0"}
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    calls = synth_execution(SynthConfig(main_calls=30, max_context=4000, subagents=2, seed=9), "e")
    forest, _ = _run([CODEC.encode_msgpack(c) for c in calls], True)
    t = forest.trees["e"]
    want = f"{t.n} {t.policy_tokens} {t.stats.calls} {int(t.ids.sum())} {float(t.logprob.sum())}"
    assert got.stdout.strip() == want


def test_the_extension_is_built_where_a_compiler_is() -> None:
    """Where gyre-traj was installed with a C compiler at hand, the extension is there (this file's
    other tests are skipped without it: this one says why, rather than passing)."""
    if os.environ.get(native.ENV) == "0":
        pytest.skip(f"{native.ENV}=0")
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    assert native.BUILT or shutil.which(compiler) is None, "a C compiler is here: build gyre_traj._ingest"
