"""The core's satellite-facing socket: one ROUTER, served by one helper thread, set up once at start.

Satellites say hello when their process starts and then long-poll with `Claim`; the server answers with
a micro-batch only while the satellite is admitted and the claim queue has work, else holds the claim up
to `idle_hold_s` and answers `Idle`. It knows the core only through the `ClaimQueue` (claims, submitted
mini-batches, the trainer's position), the `Welcome` it hands every satellite and a gradient sink: a
`Gradient` header names where each rank's shard lies, the sink reads every shard through gyre-xfer into
the matching core rank's sum, and only then is the micro-batch delivered and the satellite acked (a
transfer that fails re-queues the claim). A satellite that sends nothing (no claim, gradient or
heartbeat) for `dead_after_s` is declared dead and its claims go back to the queue. Admitting or dismissing a satellite touches only the admitted set: no sockets or process
groups are created or torn down.

The ROUTER binds through `gyre_base.sockets.bind`: beyond loopback only with the run token
(`ServerConfig.token`, else `$GYRE_TOKEN`), and with a token it is a CURVE server that admits only peers
holding it (satellites, `CoreClient`s), so nothing from anyone else reaches the decoder.

The server survives any frame sequence from any peer: a request that cannot be decoded or served is
answered with an `ErrorReply` (or a refusing `Ack` for a `Submit`), logged, and the server carries on.
Should the serving thread die anyway, the process exits loudly (`threads.start_thread`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
from gyre_base.sockets import bind, make_socket
from gyre_traj.pack import PackedBatch

from gyre_train.claimqueue import ClaimQueue
from gyre_train.claims import ClaimError
from gyre_train.handoff import BadShardError, ShardTransferError
from gyre_train.protocol import (
    PROTOCOL,
    Ack,
    AddMicrobatches,
    Admit,
    ArraySpec,
    Assign,
    Claim,
    CloseStep,
    Dismiss,
    ErrorCode,
    ErrorReply,
    Goodbye,
    Gradient,
    Heartbeat,
    Hello,
    Idle,
    OpenStep,
    Refusal,
    ReplicaInfo,
    Reply,
    Shutdown,
    Status,
    StatusReply,
    Submit,
    Welcome,
    request_decoder,
    satellite_refusal,
)
from gyre_train.threads import start_thread
from gyre_train.wire import MicroBatchError, from_frames, microbatch_from_arrays

log = logging.getLogger("gyre_train.server")


def _microbatches(specs: tuple[tuple[ArraySpec, ...], ...], frames: list[Any]) -> list[PackedBatch]:
    """The micro-batches a feeder's frames carry, copied out of the ZeroMQ frames (they may wait in the
    queue for a while); MicroBatchError if the frames do not match the specs."""
    mbs = []
    at = 0
    for sp in specs:
        arrays = from_frames(sp, [f.buffer for f in frames[at : at + len(sp)]])
        mbs.append(microbatch_from_arrays({k: v.copy() for k, v in arrays.items()}))
        at += len(sp)
    if at != len(frames):
        raise MicroBatchError(f"{len(frames)} frames for {at} arrays")
    return mbs


@dataclass
class _Replica:
    name: str
    last_seen: float
    admitted_at: float | None = None
    first_gradient_at: float | None = None
    claims: int = 0
    polls: int = 0
    gradients: int = 0
    last_pull_s: float = 0.0
    last_compute_s: float = 0.0
    last_handoff_s: float = 0.0
    """The core's read of its last gradient's shards into the sums (seconds)."""


GradientSink = Callable[[Gradient], None]
"""Reads every rank's shard of a satellite's gradient into the matching core rank's sum; raises
`handoff.BadShardError` (the header does not fit) or `handoff.ShardTransferError` (the transfer failed)."""


@dataclass(frozen=True)
class ServerConfig:
    bind: str
    """ROUTER address (loopback unless you mean otherwise; beyond loopback it needs a token)."""
    admit_on_hello: bool = False
    dead_after_s: float = 5.0
    idle_hold_s: float = 1.0
    token: str = field(default="", repr=False)
    """The run token peers must hold (CURVE + ZAP); empty: $GYRE_TOKEN, or none (loopback only)."""


class ReplicaServer:
    def __init__(self, cfg: ServerConfig, queue: ClaimQueue, welcome: Welcome, receive: GradientSink) -> None:
        self.cfg = cfg
        self.queue = queue
        self.welcome = welcome
        self._receive = receive
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock = make_socket(self._ctx, zmq.ROUTER)
        try:
            self.address: str = bind(self._sock, cfg.bind, cfg.token, "CoreConfig.token, --token-file")
        except BaseException:
            self._sock.close(0)
            self._ctx.term()
            raise
        self._enc = msgspec.msgpack.Encoder()
        self._mu = threading.Lock()
        self._reps: dict[str, _Replica] = {}
        self._admitted: set[str] = set()
        self._parked: list[tuple[bytes, str, float]] = []
        self._dead: list[str] = []
        self._stop = threading.Event()
        self._closing = threading.Event()
        self._thread = start_thread(self._serve, "gyre-train-core")

    # ---- called from other threads -------------------------------------------------------------------

    def admit(self, replica: str) -> None:
        with self._mu:
            self._admitted.add(replica)
            rep = self._reps.get(replica)
            if rep is not None:
                rep.admitted_at = time.monotonic()
                rep.first_gradient_at = None
                rep.claims = 0  # counted since admission

    def dismiss(self, replica: str) -> None:
        with self._mu:
            self._admitted.discard(replica)

    def presumed_dead(self) -> list[str]:
        """Names of satellites declared dead so far (silent for `dead_after_s`), oldest first."""
        with self._mu:
            return list(self._dead)

    def describe(self) -> dict[str, dict[str, float | bool | int]]:
        with self._mu:
            out: dict[str, dict[str, float | bool | int]] = {}
            for r in self._reps.values():
                d: dict[str, float | bool | int] = {
                    "admitted": r.name in self._admitted,
                    "ready": r.polls > 0,
                    "claims": r.claims,
                    "gradients": r.gradients,
                    "last_pull_s": r.last_pull_s,
                    "last_compute_s": r.last_compute_s,
                    "last_handoff_s": r.last_handoff_s,
                }
                if r.admitted_at is not None and r.first_gradient_at is not None:
                    d["join_s"] = r.first_gradient_at - r.admitted_at
                out[r.name] = d
            return out

    def close(self) -> None:
        self._closing.set()
        self._thread.join(timeout=3.0)
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._sock.close()
        self._ctx.term()

    # ---- the server thread ----------------------------------------------------------------------------

    def _send(self, ident: bytes, reply: Reply, frames: list[Any] | None = None) -> None:
        head = self._enc.encode(reply)
        self._sock.send_multipart([ident, head, *(frames or [])], copy=False)

    def _serve(self) -> None:
        dec = request_decoder()
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        closing_since: float | None = None
        last_msg = time.monotonic()
        while not self._stop.is_set():
            if dict(poller.poll(20)):
                last_msg = time.monotonic()
                while True:
                    try:
                        msg = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._handle_safely(dec, msg)
            self._reap()
            self._unpark()
            if self._closing.is_set():
                # Keep answering (Shutdown) until the satellites are quiet, so none is left waiting.
                now = time.monotonic()
                closing_since = closing_since or now
                quiet = not self._parked and now - max(last_msg, closing_since) > 0.2
                if quiet or now - closing_since > 2.0:
                    return

    def _handle_safely(self, dec: msgspec.msgpack.Decoder[Any], msg: list[Any]) -> None:
        """Serve one message; whatever it holds, answer and carry on (a fault is logged, not raised)."""
        ident = bytes(msg[0].buffer)
        try:
            req = dec.decode(msg[1].buffer)
        except (msgspec.DecodeError, IndexError) as exc:
            log.warning("undecodable request (%d frames) from %r: %s", len(msg) - 1, ident, exc)
            self._send(ident, ErrorReply(ErrorCode.PROTOCOL, f"undecodable request: {exc}"))
            return
        try:
            self._handle(ident, req, msg[2:])
        except zmq.ZMQError:
            raise  # the socket itself failed: nothing more can be served
        except Exception as exc:
            log.exception("could not serve %s from %r", type(req).__name__, ident)
            self._send(ident, ErrorReply(ErrorCode.BAD_REQUEST, f"{type(req).__name__}: {exc}"))

    def _handle(self, ident: bytes, req: Any, frames: list[Any]) -> None:
        now = time.monotonic()
        if isinstance(req, Hello):
            if self._closing.is_set():
                self._send(ident, Shutdown("core is closing"))
                return
            if req.protocol != PROTOCOL:
                self._send(
                    ident, ErrorReply(ErrorCode.PROTOCOL, f"protocol {req.protocol}, core speaks {PROTOCOL}")
                )
                return
            refusal = satellite_refusal(req.cell, self.welcome.cell)
            if refusal is not None:
                self._send(ident, ErrorReply(ErrorCode.PROTOCOL, refusal))
                return
            with self._mu:
                if self.cfg.admit_on_hello:
                    self._admitted.add(req.replica)
                old = self._reps.get(req.replica)
                self._reps[req.replica] = _Replica(req.replica, now)
                if req.replica in self._admitted:
                    self._reps[req.replica].admitted_at = now
            if old is not None:  # the same name again: a restarted process; its old claims are void
                self.queue.release(req.replica)
            self._send(ident, self.welcome)
            return
        if isinstance(req, Admit | Dismiss | Status):
            self._control(ident, req)
            return
        if isinstance(req, Submit | OpenStep | AddMicrobatches | CloseStep):
            self._feed(ident, req, frames)
            return
        with self._mu:
            rep = self._reps.get(req.replica)
            if rep is not None:
                rep.last_seen = now
        if isinstance(req, Heartbeat):
            return
        if rep is None:
            self._send(
                ident,
                ErrorReply(ErrorCode.UNKNOWN_REPLICA, f"{req.replica!r}: say hello first (or declared dead)"),
            )
            return
        if isinstance(req, Claim):
            with self._mu:
                rep.polls += 1
            if self._closing.is_set():
                self._send(ident, Shutdown("core is closing"))
            elif not self._try_assign(ident, req.replica):
                if req.hold:
                    self._parked.append((ident, req.replica, now))
                else:
                    self._send(ident, Idle("no work"))
        elif isinstance(req, Gradient):
            self._gradient(ident, rep, req, frames)
        elif isinstance(req, Goodbye):
            self.queue.release(req.replica, [i for _, i in req.returned] if req.returned else None)
            with self._mu:
                self._reps.pop(req.replica, None)
                self._admitted.discard(req.replica)
            self._send(ident, Ack(True))

    def _control(self, ident: bytes, req: Admit | Dismiss | Status) -> None:
        if req.protocol != PROTOCOL:
            self._send(
                ident, ErrorReply(ErrorCode.PROTOCOL, f"protocol {req.protocol}, core speaks {PROTOCOL}")
            )
            return
        if isinstance(req, Admit):
            self.admit(req.replica)
            self._send(ident, Ack(True))
        elif isinstance(req, Dismiss):
            self.dismiss(req.replica)
            self._send(ident, Ack(True))
        else:
            reps = tuple(
                ReplicaInfo(
                    name,
                    bool(d["admitted"]),
                    bool(d["ready"]),
                    int(d["claims"]),
                    int(d["gradients"]),
                    float(d.get("join_s", -1.0)),
                )
                for name, d in sorted(self.describe().items())
            )
            p = self.queue.position()
            self._send(
                ident,
                StatusReply(
                    p.step,
                    p.version,
                    p.snapshot,
                    p.queue_position,
                    self.queue.pending(),
                    reps,
                    self.queue.steps(),
                ),
            )

    def _feed(
        self, ident: bytes, req: Submit | OpenStep | AddMicrobatches | CloseStep, frames: list[Any]
    ) -> None:
        """A step from the trajectory service: whole (`Submit`) or open, added to and closed."""
        if req.protocol != PROTOCOL:
            self._send(
                ident, ErrorReply(ErrorCode.PROTOCOL, f"protocol {req.protocol}, core speaks {PROTOCOL}")
            )
            return
        q = self.queue
        try:
            if isinstance(req, OpenStep):
                verdict = q.open(req.seq)
            elif isinstance(req, CloseStep):
                verdict = q.close(req.seq, req.microbatches, req.executions)
            elif isinstance(req, AddMicrobatches):
                verdict = q.add(req.seq, _microbatches(req.microbatches, frames))
            else:
                verdict = q.submit(req.seq, _microbatches(req.microbatches, frames), req.executions)
        except MicroBatchError as exc:
            verdict = Refusal.MALFORMED, str(exc)
        refusal, why = verdict
        if refusal is not Refusal.NONE:
            log.warning("%s of step %d refused: %s", type(req).__name__, req.seq, why)
        self._send(ident, Ack(refusal is Refusal.NONE, why, refusal))

    def _gradient(self, ident: bytes, rep: _Replica, req: Gradient, frames: list[Any]) -> None:
        """Check the claim, read every rank's shard through gyre-xfer into the core ranks' sums, then
        deliver and ack. Nothing is read for a gradient that is not wanted (another step or version, a
        duplicate); a transfer that fails re-queues the claim and refuses the gradient."""
        if frames:
            self._send(
                ident,
                ErrorReply(ErrorCode.BAD_GRADIENT, f"a gradient header takes no frames, got {len(frames)}"),
            )
            return
        try:
            ok, why = self.queue.acceptable(req.replica, req.batch, req.index, req.version)
        except ClaimError as exc:
            self._send(ident, ErrorReply(ErrorCode.BAD_GRADIENT, str(exc)))
            return
        if not ok:
            self._send(ident, Ack(False, why))
            return
        t0 = time.perf_counter()
        try:
            self._receive(req)
        except BadShardError as exc:
            self._send(ident, ErrorReply(ErrorCode.BAD_GRADIENT, str(exc)))
            return
        except ShardTransferError as exc:
            self.queue.release(req.replica, [req.index])
            log.warning("gradient of micro-batch %d from %s not read: %s", req.index, req.replica, exc)
            self._send(ident, Ack(False, f"transfer failed: {exc}"))
            return
        handoff_s = time.perf_counter() - t0
        try:
            ok, why = self.queue.deliver(req.replica, req.batch, req.index, req.version, req.metrics)
        except ClaimError as exc:
            self._send(ident, ErrorReply(ErrorCode.BAD_GRADIENT, str(exc)))
            return
        if ok:
            with self._mu:
                rep.gradients += 1
                rep.last_pull_s = float(req.metrics.get("pull_s", 0.0)) or rep.last_pull_s
                rep.last_compute_s = float(req.metrics.get("compute_s", 0.0))
                rep.last_handoff_s = handoff_s
                if rep.first_gradient_at is None:
                    rep.first_gradient_at = time.monotonic()
        self._send(ident, Ack(ok, why))

    def _try_assign(self, ident: bytes, replica: str) -> bool:
        with self._mu:
            if replica not in self._admitted or replica not in self._reps:
                return False
        a = self.queue.claim(replica)
        if a is None:
            return False
        with self._mu:
            rep = self._reps.get(replica)
            if rep is not None:
                rep.claims += 1
        msg = Assign(a.batch, a.index, a.version, a.snapshot, a.specs, self.welcome.attention)
        self._send(ident, msg, a.frames)
        return True

    def _unpark(self) -> None:
        if not self._parked:
            return
        now = time.monotonic()
        keep = []
        for ident, replica, since in self._parked:
            if self._closing.is_set():
                self._send(ident, Shutdown("core is closing"))
            elif self._try_assign(ident, replica):
                continue
            elif now - since > self.cfg.idle_hold_s:
                self._send(ident, Idle("not admitted" if replica not in self._admitted else "no work"))
            else:
                keep.append((ident, replica, since))
        self._parked = keep

    def _reap(self) -> None:
        now = time.monotonic()
        limit = self.cfg.dead_after_s
        with self._mu:
            gone = [r.name for r in self._reps.values() if now - r.last_seen > limit]
            for name in gone:
                del self._reps[name]  # admission stays: a satellite that was only slow says hello again
                self._dead.append(name)
        for name in gone:
            self.queue.release(name)
            for ident, _, _ in (p for p in self._parked if p[1] == name):
                self._send(
                    ident, ErrorReply(ErrorCode.UNKNOWN_REPLICA, f"{name!r}: presumed dead, say hello again")
                )
            self._parked = [p for p in self._parked if p[1] != name]
