"""The core's server against hostile peers, on a real ROUTER socket with real ZeroMQ frames: any frame
sequence gets an answer (or none, for a heartbeat) and the server keeps serving; dtypes outside the
allow-list are refused; a serving thread that dies anyway takes its process down loudly; and an empty
mini-batch is skipped, not fatal."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
from gyre_train.control import CoreClient, InboxFull, SubmitRefused
from gyre_train.core import Core, CoreConfig
from gyre_train.data import synthetic_minibatch
from gyre_train.model import ModelConfig, build_model
from gyre_train.protocol import (
    PROTOCOL,
    Ack,
    ArraySpec,
    ErrorCode,
    ErrorReply,
    Refusal,
    Status,
    StatusReply,
    Submit,
    reply_decoder,
)
from gyre_train.threads import THREAD_DIED
from gyre_train.wire import microbatch_arrays, to_frames
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MC = ModelConfig()
A = synthetic_minibatch(4, seed=1)
TAGS = (
    "hello", "claim", "grad", "beat", "bye", "admit", "dismiss", "submit", "status", "open", "add", "close",
    "nope",
)  # fmt: skip


@pytest.fixture(scope="module")
def core() -> Iterator[Core]:
    c = Core(build_model(MC), MC, CoreConfig(token_budget=512, idle_hold_s=0.02))
    try:
        yield c
    finally:
        c.close()


class Peer:
    """A raw DEALER: sends any frames, reads replies until the core answers a Status."""

    def __init__(self, address: str) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.enc = msgspec.msgpack.Encoder()
        self.dec = reply_decoder()

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def replies_until_status(self) -> list[Any]:
        """Ask for the status and return every reply that came before it: the server is still serving."""
        self.sock.send(self.enc.encode(Status(PROTOCOL)))
        got = []
        while True:
            assert self.sock.poll(20_000), "the core stopped answering"
            rep = self.dec.decode(self.sock.recv_multipart()[0])
            if isinstance(rep, StatusReply):
                return got
            got.append(rep)

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def _submit_frames(specs: list[tuple[str, str, tuple[int, ...]]], frames: list[bytes]) -> list[bytes]:
    head = msgspec.msgpack.encode(Submit(PROTOCOL, 0, (tuple(ArraySpec(*s) for s in specs),)))
    return [head, *frames]


def test_bad_submits_are_refused_and_the_server_carries_on(core: Core) -> None:
    peer = Peer(core.address)
    good_specs, good_frames = to_frames(microbatch_arrays(A[0]))
    specs = [(s.name, s.dtype, s.shape) for s in good_specs]
    frames = [bytes(f) for f in good_frames]
    try:
        cases = {
            # np.dtype raises TypeError for these: once enough to silence the core's server for good.
            "unknown dtype": _submit_frames([("input_ids", "<q9", (4,)), *specs[1:]], frames),
            "object dtype": _submit_frames([("input_ids", "|O", (2,)), *specs[1:]], frames),
            "big-endian": _submit_frames([("input_ids", ">i4", specs[0][2]), *specs[1:]], frames),
            "negative shape": _submit_frames([("input_ids", "<i4", (-1, -4)), *specs[1:]], frames),
            "absurd shape": _submit_frames([("input_ids", "<i4", (2**62, 4)), *specs[1:]], frames),
            "truncated": _submit_frames(specs, frames[:-3]),
            "extra frame": _submit_frames(specs, [*frames, b"\x00" * 8]),
            "float ids": _submit_frames(
                [("input_ids", "<f4", specs[0][2]), *specs[1:]],
                [np.asarray(A[0].input_ids, np.float32).tobytes(), *frames[1:]],
            ),
            "repeated name": _submit_frames([specs[1], *specs[1:]], [frames[1], *frames[1:]]),
        }
        for what, msg in cases.items():
            peer.send(msg)
            (rep,) = peer.replies_until_status()
            assert isinstance(rep, Ack) and not rep.accepted, what
            assert rep.refusal is Refusal.MALFORMED, (what, rep)
        # Wrong types, unknown tags, one frame or many: an error reply each, and the server still serves.
        for msg in (
            [msgspec.msgpack.encode(["hello", "two", 3])],
            [msgspec.msgpack.encode(["nope", 1])],
            [b"", b"", b""],
            [msgspec.msgpack.encode(["submit", PROTOCOL, 0, [[["x", 5, "y"]]]])],
        ):
            peer.send(msg)
            (rep,) = peer.replies_until_status()
            assert isinstance(rep, ErrorReply) and rep.code == ErrorCode.PROTOCOL
        # Nothing was queued, and a good mini-batch is taken afterwards.
        assert core.queue_position == 0 and core.next_step(0.0) is None
        feeder = CoreClient(core.address)
        try:
            feeder.submit(0, A)
            assert core.next_step(5.0) is not None
        finally:
            feeder.close()
    finally:
        peer.close()


_field = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.floats(allow_nan=True),
    st.booleans(),
    st.none(),
    st.lists(st.one_of(st.integers(-3, 3), st.text(max_size=4)), max_size=3),
)
_spec = st.tuples(
    st.sampled_from(["input_ids", "weights", "x", ""]),
    st.sampled_from(["<i4", "<f4", "<i8", "|O", "<U3", "V8", "<q9", "", "int", "<M8"]),
    st.lists(st.integers(-2, 2**40), max_size=3),
)


@st.composite
def _message(draw: st.DrawFn) -> list[bytes]:
    tag = draw(st.sampled_from(TAGS))
    if tag in ("submit", "add"):
        head = [tag, draw(st.sampled_from([PROTOCOL, 0])), draw(st.integers(-1, 2))]
        head.append(draw(st.lists(st.lists(_spec, max_size=4), max_size=2)))
    else:
        head = [tag, *draw(st.lists(_field, max_size=7))]
    frames = draw(st.lists(st.binary(max_size=64), max_size=4))
    return [msgspec.msgpack.encode(head), *frames]


@settings(max_examples=120, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    msgs=st.lists(st.one_of(_message(), st.lists(st.binary(max_size=32), min_size=1, max_size=3)), max_size=4)
)
def test_any_frame_sequence_leaves_the_server_serving(core: Core, msgs: list[list[bytes]]) -> None:
    peer = Peer(core.address)
    try:
        for m in msgs:
            peer.send(m)
        peer.replies_until_status()  # every message was handled and the server answers
    finally:
        peer.close()


def test_a_dead_serving_thread_ends_the_process_loudly() -> None:
    # The serving loop fails outside any one request (injected into its idle-time bookkeeping): the
    # process must not stay up with a socket nobody reads. The main thread would sleep for a minute.
    script = textwrap.dedent(
        """
        import time
        from gyre_train.core import Core, CoreConfig
        from gyre_train.model import ModelConfig, build_model
        from gyre_train.server import ReplicaServer

        def broken(self):
            raise RuntimeError("injected fault in the serving loop")

        ReplicaServer._reap = broken
        mc = ModelConfig()
        core = Core(build_model(mc), mc, CoreConfig())
        print("up", flush=True)
        time.sleep(60)
        """
    )
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert p.returncode == THREAD_DIED, p.stderr[-2000:]
    assert "thread 'gyre-train-core' died" in p.stderr
    assert "RuntimeError: injected fault in the serving loop" in p.stderr


def test_an_empty_minibatch_is_skipped_not_fatal() -> None:
    core = Core(build_model(MC), MC, CoreConfig(token_budget=512, inbox=1))
    feeder = CoreClient(core.address)
    try:
        feeder.submit(0, [])  # every execution of step 0 timed out before a call
        with pytest.raises(InboxFull) as full:
            feeder.submit(1, A)
        assert full.value.refusal is Refusal.INBOX_FULL
        step = core.next_step(5.0)
        assert step is not None and core.steps()[0].closed and core.steps()[0].microbatches == 0
        r = core.train_step(step)
        assert r.skipped and r.microbatches == 0 and r.by_replica == {}
        assert (r.step, r.version, r.snapshot, r.queue_position) == (0, 0, core.snapshot, 1)
        with pytest.raises(SubmitRefused, match="out of order: the core expects 1") as late:
            feeder.submit(0, A)
        assert late.value.refusal is Refusal.OUT_OF_ORDER
        feeder.submit(1, A)  # the next step trains as usual
        nxt = core.next_step(5.0)
        assert nxt is not None
        r = core.train_step(nxt)
        assert not r.skipped and (r.step, r.version, r.queue_position) == (1, 1, 2)
    finally:
        feeder.close()
        core.close()
