"""Protocol messages round-trip through the typed decoders; arrays survive header + raw frames; and
malformed or oversized micro-batches are refused with errors that say what is wrong."""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np
import pytest
from gyre_train.data import synthetic_minibatch
from gyre_train.protocol import (
    PROTOCOL,
    Ack,
    AddMicrobatches,
    ArraySpec,
    Assign,
    Bucket,
    CellShape,
    Claim,
    CloseStep,
    ErrorCode,
    ErrorReply,
    Goodbye,
    Gradient,
    GradShard,
    Heartbeat,
    Hello,
    Idle,
    OpenStep,
    Refusal,
    ReplicaInfo,
    Shutdown,
    StatusReply,
    StepInfo,
    Submit,
    Welcome,
    reply_decoder,
    request_decoder,
)
from gyre_train.wire import (
    MicroBatchError,
    check_microbatch,
    from_frames,
    microbatch_arrays,
    microbatch_from_arrays,
    to_frames,
)
from gyre_xfer.protocol import RegionDesc


def test_messages_round_trip() -> None:
    enc = msgspec.msgpack.Encoder()
    reqs = [
        Hello(PROTOCOL, "sat-0"),
        Hello(PROTOCOL, "sat-0", CellShape(2, 1, 1)),
        Claim("sat-0", -1),
        Claim("sat-0", 3, False),
        Gradient("sat-0", 3, 1, 2, (), {"loss": 0.5}),
        Gradient(
            "sat-0",
            3,
            1,
            2,
            (
                GradShard(
                    0, "127.0.0.1:1234", RegionDesc(1, 40, 1 << 40), 0, "float32", 10, (Bucket(0, 10),)
                ),
                GradShard(
                    1,
                    "shm:h:b",
                    RegionDesc(2, 20, 0, "gyre-1-ab-2"),
                    0,
                    "bfloat16",
                    10,
                    (Bucket(0, 6), Bucket(6, 4)),
                ),
            ),
        ),
        Heartbeat("sat-0"),
        Goodbye("sat-0", ((3, 1), (3, 4))),
        Submit(PROTOCOL, 4, ((ArraySpec("x", "<i4", (4,)),),), 6),
        OpenStep(PROTOCOL, 5),
        AddMicrobatches(PROTOCOL, 5, ((ArraySpec("x", "<i4", (4,)), ArraySpec("w", "<f4", (0,))),)),
        CloseStep(PROTOCOL, 5, 12, 8),
    ]
    dec = request_decoder()
    for r in reqs:
        assert dec.decode(enc.encode(r)) == r
    reps = [
        Welcome(PROTOCOL, "tcp://127.0.0.1:1", "shm", 0.5, "{}", "{}"),
        Welcome(
            PROTOCOL,
            "tcp://127.0.0.1:1",
            "mooncake",
            0.5,
            "{}",
            "{}",
            "flex",
            0,
            CellShape(1, 2, 1),
            ("tcp://127.0.0.1:1", "tcp://127.0.0.1:2"),
            "bfloat16",
            1 << 20,
            "tcp://127.0.0.1:3",
        ),
        Assign(0, 1, 2, 3, (ArraySpec("x", "<i4", (4,)),)),
        Idle("no work"),
        Ack(False, "dup"),
        Ack(False, "full", Refusal.INBOX_FULL),
        StatusReply(
            3,
            3,
            7,
            4,
            2,
            (ReplicaInfo("sat-0", True, True, 5, 4, 0.25),),
            (StepInfo(4, False, True, 6, 2, 1, 3),),
        ),
        Shutdown(),
        ErrorReply(ErrorCode.PROTOCOL, "bad"),
    ]
    rdec = reply_decoder()
    for r in reps:
        assert rdec.decode(enc.encode(r)) == r
    with pytest.raises(msgspec.ValidationError):
        dec.decode(enc.encode(Idle()))  # a reply is not a request


def test_frames_round_trip_empty_and_non_contiguous() -> None:
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    arrays = {
        "strided": base[:, ::2],
        "empty": np.zeros((0,), np.int64),
        "ids": np.array([1, 2, 3], np.int32),
        "bf16_words": np.array([0x3F80, 0x4000], np.uint16),
    }
    specs, frames = to_frames(arrays)
    wire = [bytes(f) for f in frames]  # what arrives is plain bytes
    back = from_frames(specs, wire)
    for k, a in arrays.items():
        np.testing.assert_array_equal(back[k], a)
        assert back[k].dtype == a.dtype
    with pytest.raises(ValueError, match="frame has"):
        from_frames(specs, [*wire[:2], b"\x00", wire[3]])
    with pytest.raises(ValueError, match="frames"):
        from_frames(specs, wire[:1])


def test_microbatch_survives_the_wire() -> None:
    b = synthetic_minibatch(2, seed=3)[0]
    specs, frames = to_frames(microbatch_arrays(b))
    back = microbatch_from_arrays(from_frames(specs, [bytes(f) for f in frames]))
    for k, v in microbatch_arrays(b).items():
        np.testing.assert_array_equal(getattr(back, k), v)
    check_microbatch(back, token_budget=1024, vocab_size=8192)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda b: {}, "over the micro-batch budget"),
        (lambda b: {"input_ids": b.input_ids + 9000}, "input_ids outside the vocabulary"),
        (lambda b: {"target_ids": -b.target_ids}, "target_ids outside the vocabulary"),
        (lambda b: {"last_desc": np.minimum(b.last_desc, 3)}, "last_desc"),
        (lambda b: {"last_desc": _break_nesting(b)}, "not nested"),
        (lambda b: {"parent": np.roll(b.parent, 1)}, "parent"),
        (lambda b: {"position_ids": b.position_ids + 1}, "position"),
        (lambda b: {"old_logprobs": b.old_logprobs + 5.0}, "old_logprobs"),
        (lambda b: {"weights": np.full_like(b.weights, np.nan)}, "weights"),
        (lambda b: {"target_pos": b.target_pos[:-1]}, "target_pos has shape"),
        (lambda b: {"input_ids": b.input_ids[:0]}, "no tokens"),
    ],
)
def test_malformed_microbatches_are_rejected(change: object, message: str) -> None:
    b = synthetic_minibatch(2, seed=3)[0]
    budget = b.num_tokens - 1 if message.startswith("over") else 1024
    bad = dataclasses.replace(b, **change(b))  # type: ignore[operator]
    with pytest.raises(MicroBatchError, match=message):
        check_microbatch(bad, token_budget=budget, vocab_size=8192, where="7")


def _break_nesting(b: object) -> np.ndarray:
    """Give a child a subtree that reaches past its parent's (its parent's last_desc stays put)."""
    ld = b.last_desc.copy()  # type: ignore[attr-defined]
    par = b.parent  # type: ignore[attr-defined]
    child = int(np.flatnonzero((par >= 0) & (ld[np.maximum(par, 0)] < ld.shape[0] - 1))[0])
    ld[child] = ld.shape[0] - 1
    return ld


def test_satellite_shapes_beside_a_core() -> None:
    # The core's shape, or one rank beside a core of one pipeline stage; any other refusal names both.
    from gyre_train.protocol import satellite_refusal

    one, tp2 = CellShape(), CellShape(tp=2)
    assert satellite_refusal(tp2, tp2) is None and satellite_refusal(one, one) is None
    assert satellite_refusal(one, tp2) is None and satellite_refusal(one, CellShape(tp=2, dp=2)) is None
    gather = satellite_refusal(tp2, one)
    assert gather is not None and "tp 2 x pp 1 x dp 1 beside a core of tp 1 x pp 1 x dp 1" in gather
    stages = satellite_refusal(one, CellShape(pp=2))
    assert stages is not None and "tp 1 x pp 2 x dp 1" in stages and "one pipeline stage" in stages
    other = satellite_refusal(CellShape(tp=4), tp2)
    assert other is not None and "tp 4 x pp 1 x dp 1" in other and "tp 2 x pp 1 x dp 1" in other
