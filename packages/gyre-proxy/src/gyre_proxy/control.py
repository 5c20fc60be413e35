"""The control socket: the proxy's link to gyre-sched, which adds, drains and removes engines at run time.

A DEALER connects to the scheduler's ROUTER, opens with `Hello(kind=PROXY)` (gyre-sched's protocol and
version) and then applies each `EngineAdd` / `EngineDrain` / `EngineRemove` to the engine pool on the
proxy's event loop; once a drained engine has no call left the proxy answers `EngineDrained`. The socket
lives on its own thread; every wait has a timeout; a `Reject` is logged and the link stays up.
"""

from __future__ import annotations

import asyncio
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

log = logging.getLogger("gyre_proxy.control")


class ControlLink:
    def __init__(self, endpoint: str, pool: EnginePool, loop: asyncio.AbstractEventLoop) -> None:
        self.endpoint = endpoint
        self.pool = pool
        self.loop = loop
        self.welcomed = threading.Event()
        self.heartbeat_s = 1.0
        self.applied: list[str] = []  # commands applied, in order (for logs and tests)
        self._out: queue.Queue[Message] = queue.Queue()
        self._stop = threading.Event()
        pool.on_drained = self._drained
        self._thread = threading.Thread(target=self._run, name="gyre-proxy-control", daemon=True)
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
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sock = dealer(ctx, self.endpoint)  # with the run token ($GYRE_TOKEN) when there is one
        try:
            sock.send(codec.encode(Hello(PeerKind.PROXY)))
            last_beat = 0.0
            while not self._stop.is_set():
                while True:
                    try:
                        out = self._out.get_nowait()
                    except queue.Empty:
                        break
                    sock.send(codec.encode(out))
                now = time.monotonic()
                if self.welcomed.is_set() and now - last_beat >= self.heartbeat_s:
                    sock.send(codec.encode(Heartbeat()))
                    last_beat = now
                if not sock.poll(20):
                    continue
                try:
                    msg = codec.decode(sock.recv())
                except ProtocolError as exc:
                    log.warning("control: %s", exc)
                    continue
                if isinstance(msg, Welcome):
                    self.heartbeat_s = max(0.05, msg.heartbeat_s / 2)
                    self.welcomed.set()
                elif isinstance(msg, Reject):
                    log.warning("scheduler rejected a message: %s", msg.reason)
                elif isinstance(msg, EngineAdd | EngineDrain | EngineRemove):
                    self.loop.call_soon_threadsafe(self._apply, msg)
        finally:
            sock.close()
            ctx.term()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
