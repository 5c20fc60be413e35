"""A client of the core's ROUTER socket for the other services: the scheduler admits and dismisses
satellites and reads the status; the trajectory service submits mini-batches in queue order (a refusal
is a `SubmitRefused` carrying the core's `Refusal` and reason, and nothing is queued; `InboxFull` is the
retryable one). Every call has a deadline."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import zmq
from gyre_traj.pack import PackedBatch
from gyre_xfer.sockets import make_socket

from gyre_train.protocol import (
    PROTOCOL,
    Ack,
    Admit,
    Dismiss,
    ErrorReply,
    Refusal,
    Reply,
    Status,
    StatusReply,
    Submit,
    reply_decoder,
)
from gyre_train.wire import microbatch_arrays, to_frames


class ControlError(RuntimeError):
    """The core refused the request or did not answer in time."""


class SubmitRefused(ControlError):
    """The core did not queue the mini-batch; `refusal` says why (nothing was queued)."""

    def __init__(self, refusal: Refusal, message: str) -> None:
        super().__init__(message)
        self.refusal = refusal


class InboxFull(SubmitRefused):
    """The core's inbox is full: submit the same mini-batch again later."""


class CoreClient:
    def __init__(self, address: str, timeout_s: float = 10.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock = make_socket(self._ctx, zmq.DEALER)
        self._sock.connect(address)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = reply_decoder()

    def _ask(self, req: Any) -> Reply:
        self._sock.send(self._enc.encode(req))
        return self._reply()

    def _reply(self) -> Reply:
        if not self._sock.poll(int(self.timeout_s * 1000)):
            # A DEALER with an unanswered request would pair the next reply wrongly: start afresh.
            self._sock.close()
            self._sock = make_socket(self._ctx, zmq.DEALER)
            self._sock.connect(self.address)
            raise ControlError(f"core at {self.address} did not answer within {self.timeout_s} s")
        rep = self._dec.decode(self._sock.recv())
        if isinstance(rep, ErrorReply):
            raise ControlError(f"core error {rep.code.name}: {rep.message}")
        return rep

    def admit(self, replica: str) -> None:
        if not isinstance(self._ask(Admit(PROTOCOL, replica)), Ack):
            raise ControlError("expected an ack")

    def dismiss(self, replica: str) -> None:
        if not isinstance(self._ask(Dismiss(PROTOCOL, replica)), Ack):
            raise ControlError("expected an ack")

    def submit(self, seq: int, microbatches: Sequence[PackedBatch]) -> None:
        """Hand mini-batch `seq` (the core's next queue position) to the core. An empty one is queued and
        skipped (no update) when its turn comes. Raises `InboxFull` (retry later) or `SubmitRefused`
        (out of order, a malformed micro-batch) with the core's reason; ControlError on no answer."""
        specs, frames = [], []
        for b in microbatches:
            sp, fr = to_frames(microbatch_arrays(b))
            specs.append(sp)
            frames += fr
        self._sock.send_multipart(
            [self._enc.encode(Submit(PROTOCOL, seq, tuple(specs))), *frames], copy=False
        )
        rep = self._reply()
        if not isinstance(rep, Ack):
            raise ControlError(f"expected an ack, got {type(rep).__name__}")
        if not rep.accepted:
            kind = InboxFull if rep.refusal is Refusal.INBOX_FULL else SubmitRefused
            raise kind(rep.refusal, f"mini-batch {seq} refused: {rep.reason}")

    def status(self) -> StatusReply:
        rep = self._ask(Status(PROTOCOL))
        if not isinstance(rep, StatusReply):
            raise ControlError(f"expected a status, got {type(rep).__name__}")
        return rep

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()
