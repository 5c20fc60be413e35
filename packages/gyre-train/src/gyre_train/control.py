"""A client of the core's ROUTER socket for the other services: the scheduler admits and dismisses
satellites and reads the status; the trajectory service gives the core its steps in queue order, whole
(`submit`) or streamed (`open_step`, `add` as groups become ready, `close_step`). Every call sends the
`protocol.py` struct the server decodes and has a deadline; a refusal is a `SubmitRefused` carrying the
core's `Refusal` and reason (nothing changed; `InboxFull` is the retryable one). The client connects with
the run token (gyre-xfer `auth`; `token`, else `$GYRE_TOKEN`): a core with a token answers only holders of
the same one, so without it every call ends in `ControlError` at its deadline.

Streaming one step, as the trajectory service does:

    client.open_step(k)                          # k = the core's next queue position
    for group in groups_as_they_become_ready:    # each group's executions packed together
        mbs, n_exec = execution_means(pack(...)) # gyre_train.normalize: weights not divided by E
        client.add(k, mbs); total += len(mbs); executions += n_exec
    client.close_step(k, total, executions)      # the core divides the summed gradient by `executions`
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import zmq
from gyre_base.sockets import connected
from gyre_base.token import TOKEN_ENV
from gyre_traj.pack import PackedBatch

from gyre_train.protocol import (
    PROTOCOL,
    Ack,
    AddMicrobatches,
    Admit,
    ArraySpec,
    CloseStep,
    Dismiss,
    ErrorReply,
    OpenStep,
    Refusal,
    Reply,
    Status,
    StatusReply,
    Submit,
    reply_decoder,
)
from gyre_train.wire import microbatch_arrays, to_frames


def _frames(microbatches: Sequence[PackedBatch]) -> tuple[tuple[tuple[ArraySpec, ...], ...], list[Any]]:
    specs, frames = [], []
    for b in microbatches:
        sp, fr = to_frames(microbatch_arrays(b))
        specs.append(sp)
        frames += fr
    return tuple(specs), frames


class ControlError(RuntimeError):
    """The core refused the request or did not answer in time."""


class SubmitRefused(ControlError):
    """The core refused a step request (`submit`, `open_step`, `add`, `close_step`); `refusal` says
    why, and nothing changed."""

    def __init__(self, refusal: Refusal, message: str) -> None:
        super().__init__(message)
        self.refusal = refusal


class InboxFull(SubmitRefused):
    """The core's inbox is full: submit the same mini-batch again later."""


class CoreClient:
    def __init__(self, address: str, timeout_s: float = 10.0, token: str = "") -> None:
        """`token`: the core's run token; empty: $GYRE_TOKEN, or none."""
        self.address = address
        self.timeout_s = timeout_s
        self._token = token
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            self._sock = self._dealer()
        except BaseException:
            self._ctx.term()
            raise
        self._enc = msgspec.msgpack.Encoder()
        self._dec = reply_decoder()

    def _dealer(self) -> zmq.Socket[bytes]:
        return connected(self._ctx, zmq.DEALER, self.address, self._token)

    def _ask(self, req: Any) -> Reply:
        self._sock.send(self._enc.encode(req))
        return self._reply()

    def _reply(self) -> Reply:
        if not self._sock.poll(int(self.timeout_s * 1000)):
            # A DEALER with an unanswered request would pair the next reply wrongly: start afresh.
            self._sock.close()
            self._sock = self._dealer()
            raise ControlError(
                f"core at {self.address} did not answer within {self.timeout_s} s (a core with a run "
                f"token answers only clients holding the same one: {TOKEN_ENV})"
            )
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

    def submit(self, seq: int, microbatches: Sequence[PackedBatch], executions: int = 1) -> None:
        """Hand step `seq` (the core's next queue position) to the core whole: `open_step`, `add` and
        `close_step` in one message, all or nothing. An empty one is accepted and skipped (no update) in
        its turn. `executions`: as in `close_step` (1: gyre-traj's whole-batch weights, divided already).
        Raises `InboxFull` (retry later) or `SubmitRefused` (out of order, a malformed micro-batch) with
        the core's reason; ControlError on no answer."""
        specs, frames = _frames(microbatches)
        self._feed(Submit(PROTOCOL, seq, specs, executions), frames)

    def open_step(self, seq: int) -> None:
        """Open step `seq` (the core's next queue position) before any of its groups is ready; it counts
        against the core's inbox like a whole one. The core starts training it as soon as it is the
        oldest step (and its turn comes), claiming micro-batches as they arrive. `SubmitRefused`:
        `OUT_OF_ORDER` (a repeat or a gap), `InboxFull`."""
        self._feed(OpenStep(PROTOCOL, seq))

    def add(self, seq: int, microbatches: Sequence[PackedBatch]) -> None:
        """Give open step `seq` more micro-batches (call it any number of times, e.g. once per group as
        it becomes ready); they are claimed at once if the step is training. Their loss weights must be
        per-execution token means, not yet divided by the step's execution count
        (`normalize.execution_means`), so that `close_step` can divide by the final count.
        `SubmitRefused`: `NOT_OPEN` (never opened, or closed), `MALFORMED` (nothing of this call is
        added)."""
        specs, frames = _frames(microbatches)
        self._feed(AddMicrobatches(PROTOCOL, seq, specs), frames)

    def close_step(self, seq: int, microbatches: int, executions: int = 1) -> None:
        """Close step `seq`: `microbatches` = how many it was given in all (a check that none was lost),
        `executions` = its executions with loss tokens (>= 1), by which the core divides the summed
        gradient (and loss) once every micro-batch is in; the update is then applied. A step closed with
        no micro-batch is skipped. `SubmitRefused`: `NOT_OPEN`, `COUNT_MISMATCH`, `MALFORMED`."""
        self._feed(CloseStep(PROTOCOL, seq, microbatches, executions))

    def _feed(self, req: Submit | OpenStep | AddMicrobatches | CloseStep, frames: Sequence[Any] = ()) -> None:
        self._sock.send_multipart([self._enc.encode(req), *frames], copy=False)
        rep = self._reply()
        if not isinstance(rep, Ack):
            raise ControlError(f"expected an ack, got {type(rep).__name__}")
        if not rep.accepted:
            kind = InboxFull if rep.refusal is Refusal.INBOX_FULL else SubmitRefused
            raise kind(rep.refusal, f"{type(req).__name__} of step {req.seq} refused: {rep.reason}")

    def status(self) -> StatusReply:
        """The core's position (step, version, snapshot, queue position), its satellites, and every
        accepted step not yet applied (`StatusReply.steps`: open or closed, micro-batches given, queued,
        claimed, done)."""
        rep = self._ask(Status(PROTOCOL))
        if not isinstance(rep, StatusReply):
            raise ControlError(f"expected a status, got {type(rep).__name__}")
        return rep

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()
