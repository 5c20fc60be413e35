"""The control socket: the proxy's link to gyre-sched, which adds, drains and removes engines at run time.

A DEALER (`gyre_sched.client.dealer`, CURVE with the run token when there is one) connects to the
scheduler's ROUTER, opens with `Hello(kind=PROXY)` (gyre-sched's protocol and version) and then applies
each `EngineAdd` / `EngineDrain` / `EngineRemove` to the engine pool on the proxy's event loop; once a
drained engine has no call left the proxy answers `EngineDrained`. The socket lives on its own thread;
every wait has a timeout and no send blocks: a message the socket cannot take now (no connection yet, a
refused handshake, a full queue) is kept and sent again later, except heartbeats, which are dropped. A
`Reject` is logged and the link stays up.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import queue
import threading
import time

import zmq
from gyre_sched.client import dealer
from gyre_sched.protocol import (
    Codec,
    EngineAdd,
    EngineDrain,
    EngineDrained,
    EngineRemove,
    Heartbeat,
    Hello,
    Message,
    PeerKind,
    ProtocolError,
    Reject,
    Welcome,
)

from gyre_proxy.engines import EnginePool
from gyre_proxy.fatal import run_or_die

log = logging.getLogger("gyre_proxy.control")


class ControlLink:
    def __init__(
        self, endpoint: str, pool: EnginePool, loop: asyncio.AbstractEventLoop, token: str = ""
    ) -> None:
        """`token`: the run token ("" reads $GYRE_TOKEN; none: a loopback scheduler without one)."""
        self.endpoint = endpoint
        self.token = token
        self.pool = pool
        self.loop = loop
        self.welcomed = threading.Event()
        self.heartbeat_s = 1.0
        self.applied: list[str] = []  # commands applied, in order (for logs and tests)
        self._out: queue.Queue[Message] = queue.Queue()
        self._stop = threading.Event()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:  # here, so that a bad token is an error at start-up, not a dead thread
            self._sock = dealer(self._ctx, endpoint, token)
        except BaseException:
            self._ctx.term()
            raise
        pool.on_drained = self._drained
        self._thread = threading.Thread(
            target=run_or_die, args=(self._run, "control link"), name="gyre-proxy-control", daemon=True
        )
        self._thread.start()

    async def _drained(self, engine_id: int) -> None:
        self._out.put(EngineDrained(engine_id))

    def _apply(self, msg: Message) -> None:
        if isinstance(msg, EngineAdd):
            self.pool.add(msg.cell_id, msg.endpoint)
        elif isinstance(msg, EngineDrain):
            self.pool.drain(msg.cell_id)
        elif isinstance(msg, EngineRemove):
            self.pool.remove(msg.cell_id, msg.failed)
        self.applied.append(f"{type(msg).__name__}:{getattr(msg, 'cell_id', '')}")

    def _run(self) -> None:
        codec = Codec()
        sock = self._sock
        pending: collections.deque[Message] = collections.deque([Hello(PeerKind.PROXY)])
        try:
            last_beat = 0.0
            while not self._stop.is_set():
                self._flush(sock, codec, pending)
                now = time.monotonic()
                if self.welcomed.is_set() and now - last_beat >= self.heartbeat_s:
                    with contextlib.suppress(zmq.Again):  # a missed heartbeat is only a late one
                        sock.send(codec.encode(Heartbeat()), zmq.NOBLOCK)
                    last_beat = now
                if sock.poll(20):
                    self._receive(sock, codec)
        finally:
            sock.close()
            self._ctx.term()

    def _flush(self, sock: zmq.Socket[bytes], codec: Codec, pending: collections.deque[Message]) -> None:
        """Send what is waiting, in order, without blocking; what the socket cannot take stays pending."""
        while True:
            try:
                pending.append(self._out.get_nowait())
            except queue.Empty:
                break
        while pending:
            try:
                sock.send(codec.encode(pending[0]), zmq.NOBLOCK)
            except zmq.Again:
                return
            pending.popleft()

    def _receive(self, sock: zmq.Socket[bytes], codec: Codec) -> None:
        try:
            msg = codec.decode(sock.recv())
        except ProtocolError as exc:
            log.warning("control: %s", exc)
            return
        if isinstance(msg, Welcome):
            self.heartbeat_s = max(0.05, msg.heartbeat_s / 2)
            self.welcomed.set()
        elif isinstance(msg, Reject):
            log.warning("scheduler rejected a message: %s", msg.reason)
        elif isinstance(msg, EngineAdd | EngineDrain | EngineRemove):
            self.loop.call_soon_threadsafe(self._apply, msg)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
