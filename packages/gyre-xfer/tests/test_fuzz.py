"""Fuzzing gyre-xfer's two ZeroMQ decoders over real CURVE sockets whose peers hold the run token: the
publisher's request decoder (hostile subscribers) and the subscriber's reply decoder (a hostile
publisher). Frames are valid messages, truncated ones, real tags over values of the wrong types,
garbage and empty frames, alone or several to a message. After every case the fuzzed side must serve a
good request: the publisher a whole, byte-exact pull; the subscriber a hello. Neither may die or hang,
and the subscriber may fail only with a gyre-xfer error."""

from __future__ import annotations

import queue
import threading
import typing
import zlib
from collections import Counter
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
from gyre_base.sockets import bind, connected, make_socket
from gyre_base.testing import fuzz_settings
from gyre_xfer.buffers import DTYPES, nbytes_of
from gyre_xfer.errors import XferError
from gyre_xfer.protocol import (
    PROTOCOL_VERSION,
    Acquire,
    ErrorCode,
    ErrorReply,
    Hello,
    Lease,
    Manifest,
    RegionDesc,
    Release,
    Released,
    Reply,
    Request,
    TensorEntry,
    TransportKind,
    Welcome,
    request_decoder,
)
from gyre_xfer.publisher import Publisher, PublisherConfig
from gyre_xfer.subscriber import Subscriber, SubscriberConfig
from gyre_xfer.transport import Config, Transport, open_transport
from hypothesis import given
from hypothesis import strategies as st

Ctx = zmq.Context[zmq.Socket[bytes]]
TOKEN = "xfer-fuzz-token-0123456789abcdef"
PUBLISHER_CASES = 1000
SUBSCRIBER_CASES = 500

pytestmark = pytest.mark.usefixtures("no_token")


_enc = msgspec.msgpack.Encoder()
_ints = st.one_of(st.integers(-3, 5), st.integers(-(2**63), 2**64 - 1))
_scalar = st.one_of(st.none(), st.booleans(), _ints, st.floats(), st.text(max_size=8), st.binary(max_size=8))
_value = st.recursive(_scalar, lambda inner: st.lists(inner, max_size=4), max_leaves=8)


def _hostile(valid: st.SearchStrategy[Any], tags: list[str]) -> st.SearchStrategy[bytes]:
    """One frame: a valid message, a truncated one, a real tag over values of any type, garbage, empty."""

    @st.composite
    def frame(draw: st.DrawFn) -> bytes:
        kind = draw(st.sampled_from(["valid", "truncated", "tagged", "garbage", "empty"]))
        if kind == "valid":
            return _enc.encode(draw(valid))
        if kind == "truncated":
            data = _enc.encode(draw(valid))
            return data[: draw(st.integers(0, max(0, len(data) - 1)))]
        if kind == "tagged":
            return _enc.encode([draw(st.sampled_from(tags)), *draw(st.lists(_value, max_size=7))])
        if kind == "garbage":
            return draw(st.binary(min_size=1, max_size=40))
        return b""

    return frame()


def _tags(union: Any) -> list[str]:
    return [t.__struct_config__.tag for t in typing.get_args(union)]


# ---- the publisher's request decoder -------------------------------------------------------------------------

_requests: st.SearchStrategy[Request] = st.one_of(
    st.builds(Hello, st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION + 1, 0]), st.text(max_size=8)),
    st.builds(Acquire, _ints),
    st.builds(Release, _ints),
)
_request_frame = _hostile(_requests, _tags(Request))
# What a DEALER sends: [request id, payload] is the protocol; anything else must be dropped or refused.
_send = st.one_of(
    st.tuples(st.binary(max_size=4), _request_frame).map(list),
    st.lists(st.one_of(_request_frame, st.binary(max_size=4)), min_size=1, max_size=4),
)


@pytest.mark.fuzz
@pytest.mark.slow
def test_publisher_decoder_fuzz_1000_batches() -> None:
    """1,000 cases, each 1-6 sends from three token-holding subscribers' sockets; after each a real
    subscriber pulls the published version whole. Leases taken by the hostile sockets are never released
    (they expire) and their ids cannot release the good subscriber's."""
    pub_tr, sub_tr = open_transport(Config(kind="shm")), open_transport(Config(kind="shm"))
    pub = Publisher(pub_tr, PublisherConfig(token=TOKEN))
    ctx: Ctx = zmq.Context()
    ran = 0
    try:
        want = np.arange(4096, dtype=np.int32)
        v = pub.publish({"w": want, "b": np.full((3, 5), 7, np.uint16)}, dtypes={"b": "bfloat16"})
        good = Subscriber(sub_tr, SubscriberConfig(pub.address, token=TOKEN, control_timeout_s=10.0))
        socks = []
        for _ in range(3):
            socks.append(connected(ctx, zmq.DEALER, pub.address, TOKEN))

        @fuzz_settings(PUBLISHER_CASES)
        @given(st.lists(st.tuples(st.integers(0, 2), _send), min_size=1, max_size=6))
        def case(batch: list[tuple[int, list[bytes]]]) -> None:
            nonlocal ran
            ran += 1
            for who, frames in batch:
                socks[who].send_multipart(frames)
            snap = good.pull(min_version=v)
            assert np.array_equal(snap.arrays["w"], want) and snap.arrays["b"].sum() == 7 * 15
            for s in socks:
                while s.poll(0):
                    s.recv_multipart()

        case()
        good.close()
    finally:
        ctx.destroy(0)
        pub.close()
        pub_tr.close()
        sub_tr.close()
    assert ran >= PUBLISHER_CASES


# ---- the subscriber's reply decoder -------------------------------------------------------------------------


def _reply_frames(endpoint: str, segments: list[str]) -> st.SearchStrategy[bytes]:
    """Hostile reply frames whose manifests sometimes name this host's endpoint and real segments (one
    of them a live gyre segment), so pulls get as far as reading."""
    names = st.one_of(
        st.sampled_from(["", ".", "..", "gyre-", "gyre-0-gone-1", *segments]), st.text(max_size=6)
    )
    region = st.builds(RegionDesc, _ints, st.one_of(st.integers(0, 1 << 12), _ints), _ints, names)
    entry = st.builds(
        TensorEntry,
        st.sampled_from(["w", "b", ""]),
        st.sampled_from(["float32", "bfloat16", "uint8", "complex"]),
        st.lists(st.integers(-1, 16), max_size=3).map(tuple),
        st.one_of(st.integers(0, 1 << 12), _ints),
        st.one_of(st.integers(0, 1 << 12), _ints),
        st.one_of(st.just(-1), _ints),
    )
    manifest = st.builds(
        Manifest,
        _ints,
        st.text(max_size=6),
        st.sampled_from(TransportKind),
        st.one_of(st.just(endpoint), st.text(max_size=12)),
        region,
        st.lists(entry, max_size=3).map(tuple),
        st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION + 1]),
    )
    replies: st.SearchStrategy[Reply] = st.one_of(
        st.builds(
            Welcome, _ints, st.text(max_size=6), st.sampled_from(TransportKind), st.text(max_size=8), _ints
        ),
        st.builds(Lease, _ints, st.floats(), manifest),
        st.builds(Released, _ints, st.booleans()),
        st.builds(ErrorReply, st.sampled_from(ErrorCode), st.text(max_size=12)),
    )
    return _hostile(replies, _tags(Reply))


Message = list[bytes | None]
"""One message of the hostile publisher; None stands for the request's id."""


@st.composite
def _plausible_manifest(draw: st.DrawFn, endpoint: str, live: RegionDesc) -> Manifest:
    """A manifest over the live segment that usually passes validation (tensors laid out in order,
    right sizes, checksums absent, right or wrong), sometimes with one field bent."""
    entries, pos = [], 0
    for name in draw(st.lists(st.sampled_from("abcd"), unique=True, max_size=3)):
        dtype = draw(st.sampled_from(sorted(DTYPES)))
        shape = tuple(draw(st.lists(st.integers(0, 6), max_size=2)))
        nbytes = nbytes_of(dtype, shape)
        pos += draw(st.integers(0, 64))
        crc = draw(st.sampled_from(["none", "right", "wrong"]))
        crc32 = {"none": -1, "right": zlib.crc32(bytes(nbytes)), "wrong": 12345}[crc]
        entries.append(TensorEntry(name, dtype, shape, pos, nbytes, crc32))
        pos += nbytes
    m = Manifest(draw(st.integers(1, 9)), "fuzz", TransportKind.SHM, endpoint, live, tuple(entries))
    bend = draw(st.sampled_from(["none", "none", "offset", "nbytes", "region", "version"]))
    if bend == "offset" and entries:
        t = entries[-1]
        entries[-1] = TensorEntry(t.name, t.dtype, t.shape, draw(_ints), t.nbytes, t.crc32)
    elif bend == "nbytes" and entries:
        t = entries[0]
        entries[0] = TensorEntry(t.name, t.dtype, t.shape, t.offset, draw(_ints), t.crc32)
    elif bend == "region":
        live = RegionDesc(live.region_id, draw(_ints), live.addr, live.shm_name)
    elif bend == "version":
        return Manifest(draw(_ints), "fuzz", TransportKind.SHM, endpoint, live, tuple(entries))
    return Manifest(m.version, m.incarnation, m.transport, m.endpoint, live, tuple(entries))


@st.composite
def _answer(draw: st.DrawFn, frame: st.SearchStrategy[bytes]) -> Message:
    """One hostile message in answer to a request."""
    shape = draw(st.sampled_from(["reply", "several frames", "id only", "another id", "no id"]))
    first = draw(frame)
    if shape == "reply":
        return [None, first]
    if shape == "several frames":
        return [None, first, *draw(st.lists(frame, min_size=1, max_size=2))]
    if shape == "id only":
        return [None]
    if shape == "another id":
        return [draw(st.binary(max_size=4)), first]
    return [first]


@st.composite
def _plan(
    draw: st.DrawFn, frame: st.SearchStrategy[bytes], lease: st.SearchStrategy[Manifest]
) -> list[list[Message]]:
    """The answers to a pull's two requests (Acquire, then Release): hostile messages, each list
    usually ending in the reply the protocol expects there (a lease of a plausible manifest; a release)."""
    acquire = draw(st.lists(_answer(frame), max_size=2))
    if draw(st.integers(0, 9)) < 7:
        acquire.append([None, _enc.encode(Lease(draw(_ints), draw(st.floats()), draw(lease)))])
    release = draw(st.lists(_answer(frame), max_size=1))
    if draw(st.integers(0, 9)) < 7:
        release.append([None, _enc.encode(Released(draw(_ints), draw(st.booleans())))])
    return [acquire, release]


class HostilePublisher:
    """A ROUTER (CURVE, with the token) that answers each request with the next planned answers, then
    with a well-formed ErrorReply for that request id, so a subscriber that drops junk does not wait out
    its timeout; Hellos in `good` mode get a real Welcome."""

    def __init__(self, ctx: Ctx, transport: Transport) -> None:
        self.sock = make_socket(ctx, zmq.ROUTER)
        self.address = bind(self.sock, "tcp://127.0.0.1:0", TOKEN)
        self.transport = transport
        self.plan: queue.Queue[list[Message]] = queue.Queue()
        self.good = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        dec = request_decoder()
        while not self.stop.is_set():
            if not self.sock.poll(20):
                continue
            ident, rid, payload = self.sock.recv_multipart()
            req = dec.decode(payload)
            if self.good.is_set() and isinstance(req, Hello):
                w = Welcome(PROTOCOL_VERSION, "fuzz", self.transport.kind, "fuzz:0", 1)
                self.sock.send_multipart([ident, rid, _enc.encode(w)])
                continue
            try:
                answers = self.plan.get_nowait()
            except queue.Empty:
                answers = []
            for msg in answers:
                self.sock.send_multipart([ident, *(rid if f is None else f for f in msg)])
            self.sock.send_multipart([ident, rid, _enc.encode(ErrorReply(ErrorCode.BUSY, "end of case"))])


@pytest.mark.fuzz
@pytest.mark.slow
def test_subscriber_decoder_fuzz_500_cases() -> None:
    """500 cases: a pull against a publisher whose answers to the lease and the release are hostile
    (undecodable, several frames, another request id, replies of the wrong kind, manifests with any
    values); the pull returns a whole snapshot or raises a gyre-xfer error, and the same subscriber then
    completes a hello."""
    tr, peer = open_transport(Config(kind="shm")), open_transport(Config(kind="shm"))
    live = peer.alloc(1 << 12)
    ctx: Ctx = zmq.Context()
    fake = HostilePublisher(ctx, tr)
    sub = Subscriber(
        tr, SubscriberConfig(fake.address, token=TOKEN, control_timeout_s=10.0, max_bytes=1 << 20)
    )
    plans = _plan(
        _reply_frames(tr.endpoint, [live.desc.shm_name]), _plausible_manifest(tr.endpoint, live.desc)
    )
    outcomes: Counter[str] = Counter()
    ran = 0
    try:

        @fuzz_settings(SUBSCRIBER_CASES)
        @given(plans)
        def case(plan: list[list[Message]]) -> None:
            nonlocal ran
            ran += 1
            fake.good.clear()
            while not fake.plan.empty():
                fake.plan.get_nowait()
            for answers in plan:
                fake.plan.put(answers)
            try:
                sub.pull()
            except XferError as e:
                outcomes[type(e).__name__] += 1
            else:
                outcomes["whole snapshot"] += 1
            fake.good.set()
            assert sub.hello().incarnation == "fuzz"

        case()
    finally:
        fake.stop.set()
        fake.thread.join(5)
        sub.close()
        fake.sock.close(0)
        ctx.term()
        tr.close()
        peer.close()
    assert ran >= SUBSCRIBER_CASES
    print(f"subscriber fuzz outcomes: {dict(outcomes)}")
    assert {"whole snapshot", "ProtocolError", "ManifestError", "ChecksumError"} <= outcomes.keys()
