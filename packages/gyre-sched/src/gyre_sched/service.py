"""The scheduler as a ZeroMQ service: one ROUTER socket, one thread, every wait bounded.

Cells, the rollout driver, the trajectory service and the proxy connect DEALERs and say Hello. The loop
polls for at most `tick_s`, applies what arrived, fails cells silent for `failure_timeout_s` (or stuck in
a switch past `switch_timeout_s`), asks the policy, and carries out its decisions as the switch protocol
in protocol.py: EngineDrain -> (EngineDrained or drain timeout) -> EngineRemove + SwitchCommand ->
SwitchDone, and back: SwitchCommand -> SwitchDone -> EngineAdd.

The ROUTER binds through `gyre_base.sockets.bind`: beyond loopback only with a run token, and then only
peers holding it (CURVE, checked by ZAP) get a frame to the decoder.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass, field

import msgspec
import zmq
from gyre_base import sockets

from gyre_sched.cells import TRAINING_SIDE, CellTable, InvariantError, TableConfig
from gyre_sched.policy import Observation, Policy, PredictivePolicy
from gyre_sched.protocol import (
    PROTOCOL_VERSION,
    Action,
    CellLost,
    Codec,
    Decision,
    EngineAdd,
    EngineDrain,
    EngineDrained,
    EngineRemove,
    GetState,
    Heartbeat,
    Hello,
    Message,
    PeerKind,
    ProtocolError,
    ReadyGroups,
    Reject,
    Role,
    State,
    SwitchCommand,
    SwitchDone,
    WaterLevel,
    Welcome,
)

log = logging.getLogger("gyre_sched.service")


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    bind: str = "tcp://127.0.0.1:5557"
    """Where the ROUTER listens; port 0 picks a free port. Beyond loopback it needs a token."""
    heartbeat_s: float = 1.0
    """Peers send something at least this often (told to them in Welcome)."""
    failure_timeout_s: float = 5.0
    """A cell silent for this long is marked failed and its work reassigned."""
    switch_timeout_s: float = 120.0
    """A cell that does not confirm a switch within this long is marked failed."""
    drain_timeout_s: float = 30.0
    """Proceed with a switch this long after EngineDrain even if the proxy has not confirmed."""
    tick_s: float = 0.05
    """Longest poll; the policy is asked at least this often."""
    max_concurrent_switches: int = 1
    keep_decisions: int = 1000
    """Decisions kept for GetState (all are logged)."""
    token: str = field(default="", repr=False)
    """The run token: peers must hold it (CURVE + ZAP); empty: $GYRE_TOKEN, or none (loopback only)."""


@dataclass(slots=True)
class _Peer:
    ident: bytes
    kind: PeerKind
    cell_id: int = -1
    endpoint: str = ""
    last_seen: float = 0.0


@dataclass(slots=True)
class _Pending:
    decision: int
    target: Role
    deadline: float
    draining: bool = False  # waiting for EngineDrained
    drained: bool = False  # a satellite drained before its core reached the training side: waits for it
    arrived: bool = False  # the cell reported TRAINING before the core did


@dataclass
class Scheduler:
    """Owns the socket and the cell table; `serve_forever` runs the loop until `stop()`."""

    policy: Policy
    config: ServiceConfig = field(default_factory=ServiceConfig)
    endpoint: str = ""

    def __post_init__(self) -> None:
        self.table = CellTable(TableConfig(max_concurrent_switches=self.config.max_concurrent_switches))
        self._ctx = zmq.Context()
        self._sock = sockets.make_socket(self._ctx, zmq.ROUTER, hwm=10000)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            self.endpoint = sockets.bind(
                self._sock, self.config.bind, self.config.token, "ServiceConfig.token, --token-file"
            )
        except BaseException:
            self.close()
            raise
        self._codec = Codec()
        self._peers: dict[bytes, _Peer] = {}
        self._cells: dict[int, _Peer] = {}
        self._proxy: _Peer | None = None
        self._pending: dict[int, _Pending] = {}
        self._next_decision = 1
        self._water = WaterLevel(unfinished=0)
        self._ready = ReadyGroups(ready=0, batch_groups=1)
        self.decisions: list[Decision] = []
        self._stop = threading.Event()
        self._t0 = time.monotonic()

    # ---- plumbing ----------------------------------------------------------------------------------
    def now(self) -> float:
        return time.monotonic() - self._t0

    def _send(self, ident: bytes, msg: Message) -> None:
        try:
            self._sock.send_multipart([ident, self._codec.encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone or queue full: the timeouts deal with it
            log.warning("could not send %s to %r: %s", type(msg).__name__, ident, exc)

    def _to_proxy(self, msg: Message) -> None:
        if self._proxy is not None:
            self._send(self._proxy.ident, msg)

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(int(self.config.tick_s * 1000)))
                if self._sock in events:
                    for _ in range(1000):
                        try:
                            frames = self._sock.recv_multipart(flags=zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self.receive(frames)
                self.step()
        finally:
            self.close()

    def _refuse(self, ident: bytes, reason: str) -> None:
        log.warning("refused a message from %r: %s", ident, reason)
        self._send(ident, Reject(reason))

    def receive(self, frames: list[bytes]) -> None:
        """Apply one ROUTER message (identity frame + the peer's frames). Anything but exactly one frame
        holding a valid message is refused with a `Reject` and changes nothing."""
        ident = frames[0]
        if len(frames) != 2:
            self._refuse(ident, f"expected one frame per message, got {len(frames) - 1}")
            return
        try:
            self._handle(ident, frames[1])
        except InvariantError as exc:  # the table refused a change and is as it was
            log.error("refused a message from %r (the cell table is unchanged): %s", ident, exc)
            self._send(ident, Reject(str(exc)))

    # ---- one round -----------------------------------------------------------------------------------
    def observation(self) -> Observation:
        w, r = self._water, self._ready
        return Observation(
            now=self.now(),
            unfinished=w.unfinished,
            trainable=r.ready,
            batch_groups=r.batch_groups,
            batch_complete=r.ready >= r.batch_groups if r.batch_complete is None else r.batch_complete,
            step_open=r.step_open,
            version=r.version,
            mean_staleness=r.mean_staleness,
            ages=w.elapsed_s,
            age_counts=w.elapsed_count,
            admission_held=w.admission_held,
        )

    def step(self) -> None:
        """Fail silent cells, finish timed-out drains, then ask the policy and start its switches."""
        now = self.now()
        for cid, peer in list(self._cells.items()):
            cell = self.table.cells.get(cid)
            if cell is None or cell.role is Role.FAILED:
                continue
            if now - peer.last_seen > self.config.failure_timeout_s:
                self._fail(cid, f"silent for {now - peer.last_seen:.2f}s")
                continue
            pend = self._pending.get(cid)
            if pend is not None and pend.draining and not pend.drained and now >= pend.deadline:
                log.info(
                    "cell %d: no EngineDrained within %.1fs; switching anyway",
                    cid,
                    self.config.drain_timeout_s,
                )
                self._drained(cid)
            elif pend is not None and not pend.draining and now >= pend.deadline:
                self._fail(cid, f"switch {pend.decision} not confirmed in {self.config.switch_timeout_s}s")
        for d in self.policy.decide(self.observation(), self.table):
            self._start(d)

    def _start(self, d: Decision) -> None:
        now = self.now()
        try:
            if d.action is Action.TO_TRAINING:
                self.table.transition(d.cell_id, Role.DRAINING, now, protects=d.protects)
            else:
                self.table.transition(d.cell_id, Role.TO_ROLLOUT, now)
        except InvariantError as exc:
            log.error("policy %s proposed an illegal switch: %s (%s)", self.policy.name, d, exc)
            return
        did = self._next_decision
        self._next_decision += 1
        self.decisions.append(d)
        del self.decisions[: -self.config.keep_decisions]
        log.info(
            "decision %d: cell %d %s (%s) %s",
            did,
            d.cell_id,
            d.action.name,
            d.rule,
            msgspec.json.encode(d.why).decode(),
        )
        if d.action is Action.TO_TRAINING:
            self._pending[d.cell_id] = _Pending(
                did, Role.TRAINING, now + self.config.drain_timeout_s, draining=True
            )
            if self._proxy is None:
                self._drained(d.cell_id)
            else:
                self._to_proxy(EngineDrain(d.cell_id))
        else:
            self._pending[d.cell_id] = _Pending(did, Role.ROLLOUT, now + self.config.switch_timeout_s)
            self._command(d.cell_id, did, Role.ROLLOUT)

    def _command(self, cid: int, did: int, role: Role) -> None:
        cell = self.table.cells[cid]
        self._send(self._cells[cid].ident, SwitchCommand(did, role, cell.is_core))

    def _drained(self, cid: int) -> None:
        pend = self._pending.get(cid)
        cell = self.table.cells.get(cid)
        if pend is None or not pend.draining or cell is None or cell.role is not Role.DRAINING:
            return
        core = self.table.core
        if not cell.is_core and (core is None or core.role not in TRAINING_SIDE):
            # Whole-pool switches (Colocate) drain every cell at once; a satellite whose engine drained
            # first may not start training before the core does, so it waits for the core's drain.
            pend.drained = True
            return
        self._to_proxy(EngineRemove(cid))
        self.table.transition(cid, Role.TO_TRAINING, self.now())
        pend.draining = False
        pend.drained = False
        pend.deadline = self.now() + self.config.switch_timeout_s
        self._command(cid, pend.decision, Role.TRAINING)
        if cell.is_core:
            for other, op in list(self._pending.items()):
                if op.drained:
                    self._drained(other)

    def _fail(self, cid: int, why: str) -> None:
        cell = self.table.cells[cid]
        was = cell.role
        log.warning("cell %d failed (%s) in %s", cid, why, was.name)
        recalled = self.table.fail(cid, self.now())
        self._pending.pop(cid, None)
        if was in (Role.ROLLOUT, Role.DRAINING):
            self._to_proxy(EngineRemove(cid, failed=True))
        elif was in TRAINING_SIDE and not cell.is_core:
            core = self.table.core
            if core is not None and core.role is not Role.FAILED:
                self._send(self._cells[core.cell_id].ident, CellLost(cid))
        for other in recalled:  # the core failed: satellites go back to rollout
            did = self._next_decision
            self._next_decision += 1
            self._pending[other] = _Pending(did, Role.ROLLOUT, self.now() + self.config.switch_timeout_s)
            self._command(other, did, Role.ROLLOUT)

    # ---- messages ------------------------------------------------------------------------------------
    def _handle(self, ident: bytes, data: bytes) -> None:
        try:
            msg = self._codec.decode(data)
        except ProtocolError as exc:
            self._refuse(ident, str(exc))
            return
        peer = self._peers.get(ident)
        if isinstance(msg, Hello):
            self._hello(ident, msg)
            return
        if peer is None:
            self._refuse(ident, "say Hello first")
            return
        peer.last_seen = self.now()
        if isinstance(msg, Heartbeat):
            return
        if isinstance(msg, WaterLevel):
            if len(msg.elapsed_s) != len(msg.elapsed_count) or len(msg.finished_s) != len(
                msg.finished_timeout
            ):
                self._refuse(ident, "WaterLevel: paired fields differ in length")
                return
            self._water = msg
            if isinstance(self.policy, PredictivePolicy) and self.policy.model is not None:
                for dur, to in zip(msg.finished_s, msg.finished_timeout, strict=True):
                    self.policy.model.observe(dur, to)
        elif isinstance(msg, ReadyGroups):  # the decoder checked batch_groups >= 1 and ready >= 0
            self._ready = msg
        elif isinstance(msg, SwitchDone):
            self._switch_done(ident, msg)
        elif isinstance(msg, EngineDrained):
            self._drained(msg.cell_id)
        elif isinstance(msg, GetState):
            self._send(
                ident,
                State(self.table.views(), self._water.unfinished, self._ready.ready, tuple(self.decisions)),
            )
        else:
            self._refuse(ident, f"{type(msg).__name__} is not sent to the scheduler")

    def _hello(self, ident: bytes, msg: Hello) -> None:
        if msg.protocol != PROTOCOL_VERSION:
            self._refuse(
                ident, f"protocol {msg.protocol} unsupported; this scheduler speaks {PROTOCOL_VERSION}"
            )
            return
        if msg.kind is PeerKind.CELL and msg.cell_id < 0:
            self._refuse(ident, f"a cell needs an id >= 0, got {msg.cell_id}")
            return
        known = self._peers.get(ident)
        if (
            known is not None
            and known.kind is PeerKind.CELL
            and (msg.kind is not PeerKind.CELL or msg.cell_id != known.cell_id)
        ):  # its commands and liveness are tied to that cell: one peer, one cell
            self._refuse(ident, f"this peer is cell {known.cell_id}; it cannot say Hello as another")
            return
        peer = _Peer(ident, msg.kind, msg.cell_id, msg.endpoint, self.now())
        if msg.kind is PeerKind.CELL:
            try:
                self.table.add(msg.cell_id, is_core=msg.is_core, capacity=msg.capacity, now=self.now())
            except InvariantError as exc:
                self._refuse(ident, str(exc))
                return
            self._cells[msg.cell_id] = peer
            self._to_proxy(EngineAdd(msg.cell_id, msg.endpoint))
            log.info("cell %d registered (core=%s, capacity=%d)", msg.cell_id, msg.is_core, msg.capacity)
        elif msg.kind is PeerKind.PROXY:
            self._proxy = peer
            for cell in self.table.in_role(Role.ROLLOUT):
                self._send(ident, EngineAdd(cell.cell_id, self._cells[cell.cell_id].endpoint))
        self._peers[ident] = peer
        self._send(
            ident, Welcome(PROTOCOL_VERSION, Role.ROLLOUT, self.config.heartbeat_s, self.policy.admission)
        )

    def _switch_done(self, ident: bytes, msg: SwitchDone) -> None:
        pend = self._pending.get(msg.cell_id)
        peer = self._cells.get(msg.cell_id)
        if (
            pend is None
            or peer is None
            or peer.ident != ident
            or pend.decision != msg.decision
            or pend.draining  # the cell has not been told to switch yet
        ):
            self._refuse(ident, f"no switch {msg.decision} commanded to cell {msg.cell_id}")
            return
        if msg.role is not pend.target:
            self._fail(msg.cell_id, f"reported {msg.role.name} for a switch to {pend.target.name}")
            return
        self._finish(msg.cell_id, pend)
        if self.table.cells[msg.cell_id].is_core and msg.role is Role.TRAINING:
            for cid, other in list(self._pending.items()):  # satellites that arrived before the core
                if other.arrived:
                    self._finish(cid, other)

    def _finish(self, cid: int, pend: _Pending) -> None:
        core = self.table.core
        cell = self.table.cells[cid]
        if (
            pend.target is Role.TRAINING
            and not cell.is_core
            and (core is None or core.role is not Role.TRAINING)
        ):
            pend.arrived = True
            return
        self.table.transition(cid, pend.target, self.now())
        del self._pending[cid]
        if pend.target is Role.ROLLOUT:
            self._to_proxy(EngineAdd(cid, self._cells[cid].endpoint))


def serve_main(sched: Scheduler) -> int:
    """Run `sched` as a process's main loop: SIGTERM or Ctrl-C stop it cleanly (0). If the loop dies of
    anything else, the process must not linger with a socket nobody reads: the traceback is logged and
    the exit status is 1."""
    signal.signal(signal.SIGTERM, lambda *_: sched.stop())
    try:
        sched.serve_forever()
    except KeyboardInterrupt:
        return 0
    except Exception:
        log.critical("the scheduler loop died; exiting", exc_info=True)
        return 1
    return 0
