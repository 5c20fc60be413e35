"""Protocol messages round-trip exactly; manifests that could mislead a pull are rejected by `validate`."""

from __future__ import annotations

import msgspec
import pytest
from gyre_xfer.buffers import BufferView
from gyre_xfer.errors import ManifestError, ShapeMismatchError
from gyre_xfer.manifest import match_destinations, validate
from gyre_xfer.protocol import (
    PROTOCOL_VERSION,
    Acquire,
    ErrorCode,
    ErrorReply,
    Hello,
    KvOffer,
    KvPlane,
    KvPoolDesc,
    KvReceipt,
    Lease,
    Manifest,
    RegionDesc,
    Release,
    Released,
    TensorEntry,
    TransportKind,
    Welcome,
    kv_pool_decoder,
    reply_decoder,
    request_decoder,
)
from hypothesis import given
from hypothesis import strategies as st

dtypes = st.sampled_from(["float32", "bfloat16", "float16", "int64", "uint8"])
ITEM = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "uint8": 1}


@st.composite
def manifests(draw: st.DrawFn) -> Manifest:
    n = draw(st.integers(0, 6))
    entries = []
    pos = 0
    for i in range(n):
        dt = draw(dtypes)
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
        nbytes = ITEM[dt]
        for d in shape:
            nbytes *= d
        pos += draw(st.integers(0, 64))
        entries.append(TensorEntry(f"layers.{i}.w", dt, shape, pos, nbytes, draw(st.integers(-1, 2**32 - 1))))
        pos += nbytes
    region = RegionDesc(draw(st.integers(1, 9)), pos + draw(st.integers(0, 8)), draw(st.integers(0, 2**48)))
    return Manifest(
        draw(st.integers(1, 10**6)), "abc", TransportKind.MOONCAKE, "127.0.0.1:1234", region, tuple(entries)
    )


@given(manifests())
def test_manifest_round_trip_and_valid(m: Manifest) -> None:
    enc = msgspec.msgpack.Encoder()
    lease = Lease(3, 1.5, m)
    assert reply_decoder().decode(enc.encode(lease)) == lease
    validate(m)


def test_every_message_round_trips() -> None:
    enc = msgspec.msgpack.Encoder()
    for req in (Hello(PROTOCOL_VERSION, "me"), Acquire(4), Acquire(), Release(9)):
        assert request_decoder().decode(enc.encode(req)) == req
    for rep in (
        Welcome(PROTOCOL_VERSION, "inc", TransportKind.SHM, "shm:x", 0),
        Released(2, False),
        ErrorReply(ErrorCode.NO_VERSION, "none"),
    ):
        assert reply_decoder().decode(enc.encode(rep)) == rep
    desc = KvPoolDesc(
        TransportKind.MOONCAKE,
        "127.0.0.1:5",
        "i",
        (RegionDesc(1, 4096, 1 << 40),),
        (KvPlane(0, 0), KvPlane(0, 2048)),
        1,
        2,
        1024,
    )
    assert kv_pool_decoder().decode(enc.encode(desc)) == desc
    offer = KvOffer("req-1", desc, (4, 5, 9), 40)
    receipt = KvReceipt("req-1", (4, 9), (5,))
    assert msgspec.msgpack.decode(enc.encode(offer), type=KvOffer | KvReceipt) == offer
    assert msgspec.msgpack.decode(enc.encode(receipt), type=KvOffer | KvReceipt) == receipt


def test_requests_and_replies_do_not_cross_decode() -> None:
    enc = msgspec.msgpack.Encoder()
    with pytest.raises(msgspec.ValidationError):
        request_decoder().decode(enc.encode(Released(1, True)))
    with pytest.raises(msgspec.ValidationError):
        reply_decoder().decode(enc.encode(Acquire(1)))


def _m(
    *tensors: TensorEntry, nbytes: int = 1024, version: int = 1, protocol: int = PROTOCOL_VERSION
) -> Manifest:
    return Manifest(
        version, "i", TransportKind.MOONCAKE, "127.0.0.1:1", RegionDesc(1, nbytes, 4096), tensors, protocol
    )


GOOD = TensorEntry("w", "float32", (4, 4), 0, 64, 0)


@pytest.mark.parametrize(
    ("manifest", "words"),
    [
        (_m(GOOD, protocol=PROTOCOL_VERSION + 1), "protocol"),
        (_m(GOOD, version=0), "version must be >= 1"),
        (_m(TensorEntry("w", "float33", (4,), 0, 16, 0)), "unknown dtype"),
        (_m(TensorEntry("w", "float32", (4, 4), 0, 60, 0)), "needs 64"),
        (_m(TensorEntry("w", "float32", (4, -4), 0, 64, 0)), "negative dimension"),
        (_m(TensorEntry("w", "float32", (4, 4), 1000, 64, 0)), "outside the 1024-byte region"),
        (_m(TensorEntry("w", "float32", (4, 4), -8, 64, 0)), "outside"),
        (_m(GOOD, GOOD), "appears twice"),
        (_m(GOOD, TensorEntry("v", "float32", (4,), 32, 16, 0)), "overlap"),
        (_m(TensorEntry("", "float32", (4,), 0, 16, 0)), "empty name"),
        (_m(TensorEntry("w", "float32", (4, 4), 0, 64, 2**33)), "crc32"),
    ],
)
def test_bad_manifests_are_rejected_with_the_reason(manifest: Manifest, words: str) -> None:
    with pytest.raises(ManifestError, match=words):
        validate(manifest)


def test_destinations_must_match_names_shapes_and_dtypes() -> None:
    view = BufferView(0, 64, "float32", (4, 4), "cpu", None)
    match_destinations((GOOD,), {"w": view})
    with pytest.raises(ShapeMismatchError, match=r"missing \['w'\]"):
        match_destinations((GOOD,), {"x": view})
    with pytest.raises(ShapeMismatchError, match=r"float32\[4, 4\], destination is float32\[16\]"):
        match_destinations((GOOD,), {"w": BufferView(0, 64, "float32", (16,), "cpu", None)})
    with pytest.raises(ShapeMismatchError, match="bfloat16"):
        match_destinations((GOOD,), {"w": BufferView(0, 32, "bfloat16", (4, 4), "cpu", None)})
