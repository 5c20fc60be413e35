"""Where TITO records go: an append-only, fsynced local log and a ZeroMQ PUSH to the trajectory service.

`RecordSink.write` returns once the record is on disk (the log is written with one fsync per batch of
records waiting at that moment, so many concurrent calls share a sync), and only then may the call's
response complete: a crash loses no completed call. The same bytes then go out over PUSH without blocking
(a finite high-water mark; a record the socket cannot take now is counted and stays in the log).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import zmq
from gyre_traj.io import MAGIC, Codec
from gyre_traj.records import Call

log = logging.getLogger("gyre_proxy.sink")
_FRAME = struct.Struct("<I")


@dataclass
class SinkStats:
    written: int = 0
    pushed: int = 0
    push_dropped: int = 0
    fsyncs: int = 0


class RecordSink:
    """One writer thread owns the log file and the PUSH socket; callers await `write`."""

    def __init__(
        self, log_path: str | os.PathLike[str] | None, push_endpoint: str = "", hwm: int = 10000
    ) -> None:
        self.path = Path(log_path) if log_path else None
        self.stats = SinkStats()
        self._q: queue.Queue[tuple[Call, asyncio.AbstractEventLoop, asyncio.Future[None]] | None] = (
            queue.Queue()
        )
        self._fh = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fresh = not self.path.exists() or self.path.stat().st_size == 0
            if not fresh:
                with self.path.open("rb") as fh:
                    if fh.read(len(MAGIC)) != MAGIC:
                        raise ValueError(f"{self.path}: exists and is not a gyre msgpack record stream")
            self._fh = self.path.open("ab")
            if fresh:
                self._fh.write(MAGIC)
                self._fh.flush()
                os.fsync(self._fh.fileno())
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._push: zmq.Socket[bytes] | None = None
        if push_endpoint:
            self._ctx = zmq.Context()
            self._push = self._ctx.socket(zmq.PUSH)
            self._push.setsockopt(zmq.SNDHWM, hwm)
            self._push.setsockopt(zmq.LINGER, 2000)
            self._push.connect(push_endpoint)
        self._thread = threading.Thread(target=self._run, name="gyre-proxy-sink", daemon=True)
        self._thread.start()

    async def write(self, rec: Call) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._q.put((rec, loop, fut))
        await fut

    def _run(self) -> None:
        codec = Codec()
        while True:
            item = self._q.get()
            if item is None:
                break
            batch = [item]
            stop = False
            while True:
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
            payloads: list[bytes] = []
            error: Exception | None = None
            try:
                payloads = [codec.encode_msgpack(rec) for rec, _, _ in batch]
                if self._fh is not None:
                    self._fh.write(b"".join(_FRAME.pack(len(p)) + p for p in payloads))
                    self._fh.flush()
                    os.fsync(self._fh.fileno())
                    self.stats.fsyncs += 1
                self.stats.written += len(batch)
            except Exception as exc:  # disk full, closed file: the calls fail rather than lose records
                log.exception("writing %d records failed", len(batch))
                error = exc
            for _, loop, fut in batch:
                loop.call_soon_threadsafe(_resolve, fut, error)
            if error is None and self._push is not None:
                for p in payloads:
                    try:
                        self._push.send(p, zmq.NOBLOCK)
                        self.stats.pushed += 1
                    except zmq.Again:
                        self.stats.push_dropped += 1
            if stop:
                break

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(10.0)
        if self._fh is not None:
            self._fh.close()
        if self._push is not None:
            self._push.close()
        if self._ctx is not None:
            self._ctx.term()


def _resolve(fut: asyncio.Future[None], error: Exception | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        with contextlib.suppress(asyncio.InvalidStateError):
            fut.set_exception(RuntimeError(f"the record log could not be written: {error}"))
