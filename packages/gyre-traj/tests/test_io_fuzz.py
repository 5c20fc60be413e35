"""Fuzzing gyre-traj's readers (msgpack, JSONL, the foreign turn shape, and verl, slime and message-log
rows) with hypothesis: streams of
real records, then cut, flipped, spliced, given frames of the wrong types, or nothing but hostile bytes.
A reader either returns records (every one a valid record, with a `TornTailWarning` when the stream ends
in a torn record) or raises `RecordError`; never another exception, never another warning. A stream only
cut short (a writer that stopped mid-append) always reads: the whole records before the cut, and a
torn-tail warning unless the cut fell between records. Every numeric field also gets values at and
beyond the edges of its dtype (int32 ids, float32 logprobs, int64 columns, int32 versions, float64
timestamps), each edge pinned with `@example` and more drawn at random: a value is read exactly as
written or refused, never wrapped, rounded to infinity or warned about. Case counts are in the test names."""

from __future__ import annotations

import json
import struct
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from gyre_traj.io import (
    MAGIC,
    Codec,
    Record,
    TornTailWarning,
    iter_foreign,
    iter_jsonl,
    iter_msgpack,
)
from gyre_traj.readers import iter_messages, iter_slime, iter_verl
from gyre_traj.records import Call, CallBatch, Delta, EvalStatus, RecordError, Role, Score
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.fuzz


def fuzz(n: int) -> settings:
    return settings(
        max_examples=n, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
    )


def _calls(rng: np.random.Generator, n: int) -> list[Call]:
    def ids() -> np.ndarray:
        return rng.integers(0, 2**31 - 1, int(rng.integers(0, 7))).astype(np.int32)

    out: list[Call] = []
    for i in range(n):
        output = ids()
        inp: np.ndarray | None = ids()
        delta = None
        if out and rng.random() < 0.5:
            parent = out[-1]
            n_parent = parent.output_ids.size + (parent.input_ids.size if parent.input_ids is not None else 0)
            delta, inp = Delta(parent.call_id, int(rng.integers(0, n_parent + 1)), ids()), None
        out.append(
            Call(
                execution_id="e",
                call_id=f"c{i}",
                agent_id=["main", "sub-\u00e9", "\u2603"][i % 3],
                role=list(Role)[int(rng.integers(0, len(Role)))],
                input_ids=inp,
                input_delta=delta,
                output_ids=output,
                output_logprobs=-rng.random(output.size).astype(np.float32) * 9,
                weight_version=int(rng.integers(0, 9)),
                metadata={"extends": "c0"} if rng.random() < 0.3 else {},
            )
        )
    return out


def _records(seed: int) -> list[Record]:
    """A few records of every kind (calls, a call batch, scores), from a seed."""
    rng = np.random.default_rng(seed)
    recs: list[Record] = []
    for _ in range(int(rng.integers(1, 5))):
        kind = int(rng.integers(0, 3))
        if kind == 0:
            failed = bool(rng.random() < 0.3)
            recs.append(
                Score(
                    execution_id="e",
                    group_id=f"g{seed}",
                    value=None if failed else float(rng.random()),
                    status=EvalStatus.EVAL_FAILED if failed else EvalStatus.OK,
                )
            )
        elif kind == 1:
            recs.append(CallBatch.of(_calls(rng, int(rng.integers(1, 5)))))
        else:
            recs.extend(_calls(rng, int(rng.integers(1, 5))))
    return recs


BASES = [_records(seed) for seed in range(64)]
"""Real record streams to start from (built once: hypothesis spends its cases on the damage)."""
bases = st.sampled_from(BASES)


# values of every msgpack/JSON type, for fields given the wrong one
_any = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
_ext = st.builds(msgspec.msgpack.Ext, st.integers(-128, 127), st.binary(max_size=13))


def _frames(recs: list[Record]) -> list[bytes]:
    codec = Codec()
    return [codec.encode_msgpack(r) for r in recs]


def _stream(payloads: Iterable[bytes]) -> bytes:
    return MAGIC + b"".join(struct.pack("<I", len(p)) + p for p in payloads)


@st.composite
def wrong_typed_frame(draw: st.DrawFn, payload: bytes) -> bytes:
    """A record's own fields, one of them replaced (or one added) with a value of any type."""
    obj = msgspec.msgpack.decode(payload, ext_hook=lambda code, data: msgspec.msgpack.Ext(code, bytes(data)))
    assert isinstance(obj, dict)
    key = draw(st.sampled_from(sorted(obj)) | st.text(max_size=6))
    obj[key] = draw(_any | _ext)
    return msgspec.msgpack.encode(obj)


def _read(fn: Callable[[], Iterable[Record]]) -> tuple[str, list[Record]]:
    """("ok" | "torn" | "error", the records read); any other exception or warning fails the test."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            got = list(fn())
        except RecordError:
            return "error", []
    kinds = {type(w.message) for w in caught}
    assert kinds <= {TornTailWarning}, [str(w.message) for w in caught]
    for rec in got:
        assert isinstance(rec, Call | CallBatch | Score)
    return ("torn" if kinds else "ok"), got


def _same(a: list[Record], b: list[Record]) -> bool:
    enc = Codec().encode_msgpack
    return [enc(r) for r in a] == [enc(r) for r in b]


@fuzz(1000)
@given(bases, st.data())
def test_msgpack_cut_anywhere_reads_whole_records_1000_cases(recs: list[Record], data: st.DataObject) -> None:
    payloads = _frames(recs)
    stream = _stream(payloads)
    cut = data.draw(st.integers(0, len(stream)))
    outcome, got = _read(lambda: iter_msgpack(stream[:cut]))
    ends = list(np.cumsum([len(MAGIC)] + [4 + len(p) for p in payloads]))
    whole = sum(1 for e in ends[1:] if e <= cut)
    assert outcome == ("ok" if cut in ends else "torn")
    assert _same(got, recs[:whole])


@fuzz(1500)
@given(bases, st.data())
def test_msgpack_reader_fuzz_1500_cases(recs: list[Record], data: st.DataObject) -> None:
    """Flipped bytes, inserted bytes, frames of the wrong types, junk appended, then maybe a cut."""
    payloads = _frames(recs)
    how = data.draw(st.sampled_from(["flip", "insert", "wrong_types", "ext", "junk"]))
    if how == "wrong_types":
        i = data.draw(st.integers(0, len(payloads) - 1))
        payloads[i] = data.draw(wrong_typed_frame(payloads[i]))
    elif how == "ext":
        i = data.draw(st.integers(0, len(payloads) - 1))
        obj = msgspec.msgpack.decode(payloads[i], ext_hook=lambda c, d: msgspec.msgpack.Ext(c, bytes(d)))
        arrays = [k for k, v in obj.items() if isinstance(v, msgspec.msgpack.Ext)] or sorted(obj)
        obj[data.draw(st.sampled_from(arrays))] = data.draw(_ext)
        payloads[i] = msgspec.msgpack.encode(obj)
    stream = bytearray(_stream(payloads))
    if how == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            pos = data.draw(st.integers(0, len(stream) - 1))
            stream[pos] ^= data.draw(st.integers(1, 255))
    elif how == "insert":
        pos = data.draw(st.integers(0, len(stream)))
        stream[pos:pos] = data.draw(st.binary(min_size=1, max_size=9))
    elif how == "junk":
        stream += data.draw(st.binary(min_size=1, max_size=40))
    if data.draw(st.booleans()):
        del stream[data.draw(st.integers(0, len(stream))) :]
    _read(lambda: iter_msgpack(bytes(stream)))


@fuzz(500)
@given(st.binary(max_size=200), st.booleans())
def test_msgpack_reader_hostile_bytes_500_cases(raw: bytes, magic: bool) -> None:
    _read(lambda: iter_msgpack((MAGIC if magic else b"") + raw))


def _jsonl(recs: list[Record]) -> bytes:
    codec = Codec()
    return b"".join(codec.encode_json(r) + b"\n" for r in recs)


@fuzz(1000)
@given(bases, st.data())
def test_jsonl_reader_fuzz_1000_cases(recs: list[Record], data: st.DataObject) -> None:
    """Cut anywhere (always reads: whole lines, then maybe a torn one), or flipped, spliced, wrong-typed
    lines (reads or `RecordError`)."""
    text = _jsonl(recs)
    how = data.draw(st.sampled_from(["cut", "flip", "insert", "wrong_types"]))
    if how == "cut":
        cut = data.draw(st.integers(0, len(text)))
        outcome, got = _read(lambda: iter_jsonl(text[:cut].splitlines(keepends=True)))
        ends = list(np.cumsum([0] + [len(x) for x in text.splitlines(keepends=True)]))
        whole = sum(1 for e in ends[1:] if e <= cut + 1)  # a line cut just before its newline is whole
        assert outcome == ("ok" if cut in ends or cut + 1 in ends else "torn")
        assert _same(got, recs[:whole])
        return
    lines = text.splitlines(keepends=True)
    i = data.draw(st.integers(0, len(lines) - 1))
    if how == "wrong_types":
        obj: dict[str, Any] = msgspec.json.decode(lines[i])
        obj[data.draw(st.sampled_from(sorted(obj)) | st.text(max_size=6))] = data.draw(
            _any.filter(lambda v: not isinstance(v, bytes))
        )
        try:
            lines[i] = msgspec.json.encode(obj) + b"\n"
        except (OverflowError, msgspec.EncodeError):  # a value JSON cannot hold: nothing to read
            return
    else:
        line = bytearray(lines[i])
        pos = data.draw(st.integers(0, len(line) - 1))
        if how == "flip":
            line[pos] ^= data.draw(st.integers(1, 255))
        else:
            line[pos:pos] = data.draw(st.binary(min_size=1, max_size=9))
        lines[i] = bytes(line)
    _read(lambda: iter_jsonl(b"".join(lines).splitlines(keepends=True)))


@fuzz(500)
@given(st.lists(st.binary(max_size=60) | st.text(max_size=60).map(str.encode), max_size=5))
def test_jsonl_reader_hostile_lines_500_cases(lines: list[bytes]) -> None:
    _read(lambda: iter_jsonl(b"\n".join(lines).splitlines(keepends=True)))


# ------------------------------------------------------------------------------ dtype boundaries

I32, I64, U64 = 2**31, 2**63, 2**64
F32_MAX = float(np.finfo(np.float32).max)
EDGES: list[int | float] = [
    *(I32 - 1, I32, -I32, -I32 - 1),  # int32: token ids, weight versions
    *(I64 - 1, I64, -I64, -I64 - 1),  # int64: batch columns; msgpack's signed limit
    *(U64 - 1, U64, 10**30),  # uint64 (msgpack's unsigned limit), beyond it (JSON only)
    *(F32_MAX, -F32_MAX, 3.4028236e38, -3.4028236e38, -1e39, -1e300),  # float32 and past it
    *(-1e-46, -5e-324, -0.0, 2147483648.0, -2147483649.0, 9.3e18, 1.9e19, -1.5),  # subnormals, big floats
]
"""Values at and just past each dtype's limits (the cast's edge on either side)."""

_call = Call(
    execution_id="e",
    call_id="c",
    agent_id="a",
    role=Role.MAIN,
    input_ids=np.array([1001, 2001], np.int32),
    output_ids=np.array([4001, 4002], np.int32),
    output_logprobs=np.array([-0.5, -0.25], np.float32),
    weight_version=3,
)
_delta = msgspec.structs.replace(
    _call, call_id="d", input_ids=None, input_delta=Delta("c", 4, np.array([2002], np.int32))
)
BASE: dict[str, dict[str, Any]] = {
    "call": msgspec.json.decode(Codec().encode_json(_call)),
    "delta": msgspec.json.decode(Codec().encode_json(_delta)),
    "batch": msgspec.json.decode(Codec().encode_json(CallBatch.of([_call, _delta]))),
    "score": msgspec.json.decode(Codec().encode_json(Score(execution_id="e", group_id="g", value=0.5))),
    "foreign": {"prompt_ids": [1001, 2001], "output_ids": [4001, 4002], "output_logprobs": [-0.5, -0.25]},
    "sglang": {  # SGLang's own logprob entries: [logprob, token_id, text]
        "prompt_ids": [1001],
        "output_ids": [4001],
        "output_token_logprobs": [[-0.5, 4001, "x"]],
        "weight_version": "7",
    },
}
"""One valid record of each shape, as the JSON objects its writer sends."""

FIELDS: list[tuple[str, tuple[str | int, ...]]] = [
    ("call", ("input_ids",)),
    ("call", ("output_ids",)),
    ("call", ("output_logprobs",)),
    ("call", ("weight_version",)),
    ("call", ("t_start",)),
    ("delta", ("input_delta", "keep")),
    ("delta", ("input_delta", "append")),
    ("batch", ("tokens",)),
    ("batch", ("logprobs",)),
    ("batch", ("keeps",)),
    ("batch", ("input_lens",)),
    ("batch", ("output_lens",)),
    ("batch", ("weight_versions",)),
    ("batch", ("t_start",)),
    ("score", ("value",)),
    ("foreign", ("prompt_ids",)),
    ("foreign", ("output_ids",)),
    ("foreign", ("output_logprobs",)),
    ("foreign", ("weight_version",)),
    ("sglang", ("output_token_logprobs", 0, 0)),
]
"""Every numeric field a reader takes (a list field gets the value in each of its entries)."""


def _with_value(shape: str, path: tuple[str | int, ...], value: int | float) -> dict[str, Any]:
    obj = json.loads(json.dumps(BASE[shape]))
    *head, last = path
    parent = obj
    for key in head:
        parent = parent[key]
    old = parent.get(last) if isinstance(parent, dict) else parent[last]
    parent[last] = [value] * len(old) if isinstance(old, list) else value
    return obj


def _numbers_read(recs: list[Record], path: tuple[str | int, ...]) -> list[Any]:
    """The values a read record holds at `path` (foreign turns: the `Call` fields they become)."""
    names = {"prompt_ids": "input_ids", "output_token_logprobs": "output_logprobs"}
    (rec,) = recs
    got: Any = rec
    for key in path:
        if isinstance(key, int):
            continue  # inside SGLang's [logprob, id, text] entry: the logprob itself
        got = getattr(got, names.get(key, key))
    return got.tolist() if isinstance(got, np.ndarray) else [got]


def _exactly(field: tuple[str | int, ...], value: int | float, got: list[Any]) -> bool:
    """A value read back as written: integers exactly; float fields as float32 (logprobs, finite) or
    float64 (timestamps, scores) round it."""
    if field[-1] in ("output_logprobs", "logprobs", 0):
        want = float(np.float32(value))
        return all(g == want and np.isfinite(g) for g in got)
    if field[-1] in ("t_start", "value"):
        return all(g == float(value) for g in got)
    return all(g == value and type(g) is int for g in got)


@st.composite
def _numbers(draw: st.DrawFn) -> int | float:
    return draw(
        st.sampled_from(EDGES)
        | st.integers(-(2**70), 2**70)
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.floats(-F32_MAX * 4, F32_MAX * 4, allow_nan=False)
    )


def _pin_every_edge(test: Callable[..., None]) -> Callable[..., None]:
    """`@example` for each field at each edge value (the random cases come on top)."""
    for field in FIELDS:
        for value in EDGES:
            test = example(field, value)(test)
    return test


@fuzz(300)
@_pin_every_edge
@given(st.sampled_from(FIELDS), _numbers())
def test_every_numeric_field_at_its_dtype_edges_reads_exactly_or_is_refused_300_cases(
    field: tuple[str, tuple[str | int, ...]], value: int | float
) -> None:
    """A value at or past its field's dtype edge, written as JSON Lines and as msgpack (lists, as a
    foreign writer sends them), reads back exactly or is a `RecordError`; `_read` fails the test on any
    other exception or any warning (numpy's `overflow encountered in cast` included)."""
    shape, path = field
    obj = _with_value(shape, path, value)
    line = json.dumps(obj).encode() + b"\n"
    if shape in ("foreign", "sglang"):
        streams = [lambda: iter_foreign([line])]
    else:
        streams = [lambda: iter_jsonl([line])]
        try:
            payload = msgspec.msgpack.encode(obj)
        except OverflowError:  # beyond what msgpack can carry: JSON only
            pass
        else:
            streams.append(lambda: iter_msgpack(_stream([payload])))
    for read in streams:
        outcome, got = _read(read)
        if outcome == "ok":
            numbers = _numbers_read(got, path)
            assert _exactly(path, value, numbers), (field, value, numbers)


@fuzz(500)
@given(st.sampled_from(["foreign", "sglang"]), st.data())
def test_foreign_reader_fuzz_500_cases(shape: str, data: st.DataObject) -> None:
    """Foreign turns with a field of any type (or one added), or a byte flipped: a `Call` or a
    `RecordError`, nothing else."""
    obj = json.loads(json.dumps(BASE[shape]))
    if data.draw(st.booleans()):
        key = data.draw(st.sampled_from(sorted(obj)) | st.sampled_from(["role", "turn", "policy_version"]))
        obj[key] = data.draw(_any.filter(lambda v: not isinstance(v, bytes)))
        try:
            line = msgspec.json.encode(obj) + b"\n"
        except (OverflowError, msgspec.EncodeError):
            return
    else:
        raw = bytearray(json.dumps(obj).encode())
        raw[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
        line = bytes(raw) + b"\n"
    _read(lambda: iter_foreign([line]))


_FIXTURES = Path(__file__).parent / "fixtures"
_json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
"""Any value Python's `json.dumps` writes (NaN and infinities included, as it writes them)."""
TRACES: dict[str, tuple[Callable[[list[bytes]], Iterable[Record]], Path, list[tuple[str | int, ...]]]] = {
    "slime": (
        lambda lines: iter_slime(lines, reward_key="score"),
        _FIXTURES / "slime" / "samples.jsonl",
        [
            ("tokens",),
            ("response_length",),
            ("loss_mask",),
            ("rollout_log_probs",),
            ("reward",),
            ("weight_versions",),
            ("index",),
            ("rollout_id",),
            ("group_index",),
            ("status",),
            ("remove_sample",),
            ("multimodal_inputs",),
        ],
    ),
    "verl": (
        iter_verl,
        _FIXTURES / "verl" / "with_ids" / "1.jsonl",
        [
            ("prompt_ids",),
            ("response_ids",),
            ("response_mask",),
            ("response_logprobs",),
            ("score",),
            ("step",),
            ("uid",),
            ("input",),
        ],
    ),
    "vllm": (
        iter_messages,
        _FIXTURES / "messages" / "vllm_chat.jsonl",
        [
            ("response",),
            ("response", "prompt_token_ids"),
            ("response", "choices"),
            ("response", "choices", 0, "token_ids"),
            ("response", "choices", 0, "logprobs"),
            ("response", "choices", 0, "logprobs", "content"),
            ("response", "choices", 0, "logprobs", "content", 0, "logprob"),
            ("response", "choices", 0, "logprobs", "content", 0, "token"),
            ("response", "created"),
            ("response", "id"),
            ("reward",),
            ("session_id",),
            ("request",),
            ("weight_version",),
            ("role",),
        ],
    ),
    "stream": (
        iter_messages,
        _FIXTURES / "messages" / "vllm_chat_stream.jsonl",
        [
            ("response",),
            ("response", 0),
            ("response", 0, "prompt_token_ids"),
            ("response", 1, "choices"),
            ("response", 1, "choices", 0, "token_ids"),
            ("response", 1, "choices", 0, "logprobs"),
            ("response", 2, "choices", 0, "index"),
        ],
    ),
    "anthropic": (
        iter_messages,
        _FIXTURES / "messages" / "anthropic_with_ids.jsonl",
        [
            ("prompt_token_ids",),
            ("token_ids",),
            ("output_logprobs",),
            ("response", "type"),
            ("response", "stop_reason"),
            ("reward",),
        ],
    ),
}
"""Each reader of other systems' traces, a real-shaped row of its layout (the fixtures) and the paths a
fuzzer puts values at."""


@fuzz(600)
@given(st.sampled_from(sorted(TRACES)), st.data())
def test_trace_readers_fuzz_600_cases(shape: str, data: st.DataObject) -> None:
    """A verl, slime or message-log row with a value of any type put at one of its fields (or in one
    entry of a list there), a field removed, or a byte flipped: records or a `RecordError`, nothing
    else (`_read` fails the test on any other exception or any warning)."""
    reader, path, paths = TRACES[shape]
    obj = json.loads(path.read_text().splitlines()[0])
    how = data.draw(st.sampled_from(["set", "entry", "delete", "flip"]))
    if how == "flip":
        raw = bytearray(json.dumps(obj).encode())
        raw[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
        line = bytes(raw)
    else:
        *head, last = data.draw(st.sampled_from(paths))
        parent: Any = obj
        for key in head:
            parent = parent[key]
        here = parent.get(last) if isinstance(parent, dict) else parent[last]  # type: ignore[index]
        if how == "delete":
            parent.pop(last, None) if isinstance(parent, dict) else parent.pop(last)
        elif how == "entry" and isinstance(here, list) and here:
            parent[last][data.draw(st.integers(0, len(parent[last]) - 1))] = data.draw(_json_value)
        else:
            parent[last] = data.draw(_json_value)
        line = json.dumps(obj).encode()  # Python's json: NaN and Infinity as verl and slime write them
    _read(lambda: reader([line + b"\n"]))
