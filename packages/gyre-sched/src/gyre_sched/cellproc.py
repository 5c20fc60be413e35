"""A lightweight cell: a process that follows the cell side of the protocol and nothing else.

It registers, heartbeats, and answers each SwitchCommand with SwitchDone after `switch_s`; it runs no
engine and no trainer (gyre-engine and gyre-train cells implement the same messages for real). It is what
the service tests start as real processes, and a dry-run stand-in for a cluster's cells. Frames that are
not one valid message are logged and dropped; only a Reject, another protocol version or silence end it.
It connects through `gyre_sched.client.dealer`, so with a run token it speaks CURVE.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import zmq
from gyre_base.token import TOKEN_ENV

from gyre_sched.client import dealer
from gyre_sched.protocol import (
    PROTOCOL_VERSION,
    CellLost,
    Codec,
    Heartbeat,
    Hello,
    Message,
    PeerKind,
    ProtocolError,
    Reject,
    Role,
    SwitchCommand,
    SwitchDone,
    Welcome,
)

log = logging.getLogger("gyre_sched.cellproc")


@dataclass(frozen=True, slots=True)
class CellConfig:
    connect: str
    """The scheduler's ROUTER address."""
    cell_id: int
    is_core: bool = False
    capacity: int = 64
    endpoint: str = ""
    switch_s: float = 0.05
    """How long a switch takes here (stands in for freeing engine memory / loading the replica)."""
    hello_timeout_s: float = 10.0
    run_s: float = 0.0
    """Stop after this long (0: until the scheduler goes silent for `peer_timeout_s`)."""
    peer_timeout_s: float = 30.0
    token: str = field(default="", repr=False)
    """The scheduler's run token; empty: $GYRE_TOKEN, or none."""


class SchedulerGone(RuntimeError):
    pass


def _recv(sock: zmq.Socket[bytes], codec: Codec, timeout_s: float) -> Message | None:
    """The next valid message from the scheduler within `timeout_s`, or None. A frame sequence that is
    not one valid message (several frames, garbage, a wrong type or value) is logged and dropped."""
    if not sock.poll(int(timeout_s * 1000)):
        return None
    frames = sock.recv_multipart()
    if len(frames) != 1:
        log.warning("dropped a message of %d frames from the scheduler (expected 1)", len(frames))
        return None
    try:
        return codec.decode(frames[0])
    except ProtocolError as exc:
        log.warning("dropped a bad frame from the scheduler: %s", exc)
        return None


def _send(sock: zmq.Socket[bytes], codec: Codec, msg: Message) -> None:
    """Send without blocking: with no connection (a refused handshake) or a full queue the message is
    dropped and logged; the scheduler's timeouts and this cell's `peer_timeout_s` deal with the rest."""
    try:
        sock.send(codec.encode(msg), zmq.NOBLOCK)
    except zmq.Again:
        log.warning("could not send %s to the scheduler (no connection or queue full)", type(msg).__name__)


def _welcome(sock: zmq.Socket[bytes], codec: Codec, cfg: CellConfig) -> Welcome:
    """Wait for the scheduler's Welcome, ignoring anything else; a Reject, a Welcome of another protocol
    version or no Welcome within `hello_timeout_s` is SchedulerGone."""
    deadline = time.monotonic() + cfg.hello_timeout_s
    while (left := deadline - time.monotonic()) > 0:
        reply = _recv(sock, codec, left)
        if isinstance(reply, Reject):
            raise SchedulerGone(f"scheduler rejected cell {cfg.cell_id}: {reply.reason}")
        if isinstance(reply, Welcome):
            if reply.protocol != PROTOCOL_VERSION:
                raise SchedulerGone(
                    f"scheduler speaks protocol {reply.protocol}; this cell speaks {PROTOCOL_VERSION}"
                )
            return reply
        if reply is not None:
            log.warning("expected Welcome, got %s: ignored", type(reply).__name__)
    raise SchedulerGone(
        f"no Welcome from {cfg.connect} within {cfg.hello_timeout_s}s (a scheduler with a run token "
        f"answers only cells holding the same one: {TOKEN_ENV} or --token-file)"
    )


def run_cell(cfg: CellConfig) -> int:
    """Run the cell loop; returns 0 on a clean stop. Raises SchedulerGone if the scheduler goes silent."""
    codec = Codec()
    ctx = zmq.Context()
    try:
        sock = dealer(ctx, cfg.connect, cfg.token)
    except BaseException:
        ctx.term()
        raise
    try:
        hello = Hello(
            PeerKind.CELL,
            cell_id=cfg.cell_id,
            is_core=cfg.is_core,
            capacity=cfg.capacity,
            endpoint=cfg.endpoint,
        )
        _send(sock, codec, hello)
        reply = _welcome(sock, codec, cfg)
        role = reply.role
        hb = reply.heartbeat_s
        start = last_heard = last_sent = time.monotonic()
        pending: list[tuple[float, SwitchCommand]] = []
        while True:
            now = time.monotonic()
            if cfg.run_s and now - start >= cfg.run_s:
                return 0
            if now - last_heard > cfg.peer_timeout_s:
                raise SchedulerGone(f"scheduler silent for {cfg.peer_timeout_s}s")
            for due, cmd in list(pending):
                if due <= now:
                    pending.remove((due, cmd))
                    role = cmd.role
                    _send(sock, codec, SwitchDone(cfg.cell_id, role, cmd.decision))
                    last_sent = now
            if now - last_sent >= hb / 2:
                _send(sock, codec, Heartbeat(cfg.cell_id, role))
                last_sent = now
            msg = _recv(sock, codec, min(hb / 4, 0.05))
            if msg is None:
                continue
            last_heard = time.monotonic()
            if isinstance(msg, SwitchCommand):
                if msg.role in (Role.TRAINING, Role.ROLLOUT):
                    pending.append((last_heard + cfg.switch_s, msg))
                else:
                    log.warning(
                        "ignored a switch to %s (only TRAINING and ROLLOUT are targets)", msg.role.name
                    )
            elif isinstance(msg, CellLost | Reject):
                pass  # a trainer would re-queue the lost satellite's micro-batches here
    finally:
        sock.close(0)
        ctx.term()
