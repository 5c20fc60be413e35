"""Where TITO records go: an append-only, fsynced local log and a ZeroMQ PUSH to the trajectory service.

`RecordSink.write` returns once the record is on disk (one `os.write` + `fsync` per batch of records
waiting at that moment, so many concurrent calls share a sync), and only then may the call's response
complete: a crash loses no completed call. A batch that cannot be written whole (a full disk, an I/O
error) is cut off again (`ftruncate` to where the log ended before it) and its calls fail with
`RecordWriteFailed`: the log never holds a partial frame, and nothing of a failed call is written later
(the log is unbuffered). The same bytes then go out over PUSH without blocking (a finite high-water mark;
a record the socket cannot take now is counted and stays in the log), through `gyre_base.sockets` with the
run token.

Opening a log whose last frame is torn (a crash mid-append) cuts the torn bytes off before appending,
keeping them in a side file `<log>.torn-<offset>` (so nothing is appended after a torn frame, and no byte
is thrown away).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import queue
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import zmq
from gyre_base import sockets
from gyre_traj.io import MAGIC, Codec, scan_msgpack
from gyre_traj.records import Call, RecordError

from gyre_proxy.fatal import run_or_die

log = logging.getLogger("gyre_proxy.sink")
_FRAME = struct.Struct("<I")


class RecordWriteFailed(RuntimeError):
    """A call's record could not be made durable (disk full, I/O error): the call is answered with an
    error, and its record is not in the log, now or later."""


@dataclass
class SinkStats:
    written: int = 0
    pushed: int = 0
    push_dropped: int = 0
    fsyncs: int = 0
    write_failures: int = 0  # records whose write failed (their calls were answered with an error)
    torn_bytes_moved: int = 0  # bytes of a torn tail cut off the log when it was opened


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _keep_torn(path: Path, data: bytes, offset: int) -> Path:
    """Write a torn tail to a new side file next to the log (fsynced) and return its path."""
    n = 0
    while True:
        side = path.with_name(f"{path.name}.torn-{offset}" + (f".{n}" if n else ""))
        try:
            fd = os.open(side, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            n += 1
            continue
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        return side


def open_log(path: Path) -> tuple[int, int, int]:
    """Open (or create) the log for appending: (fd, length, torn bytes cut off). A log that is not a gyre
    msgpack record stream is refused (ValueError); a torn tail is moved to a side file first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
    try:
        size = os.fstat(fd).st_size
        end, torn = 0, 0
        if size:
            with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mm:
                try:
                    scan = scan_msgpack(mm, str(path))
                except RecordError:
                    raise ValueError(f"{path}: exists and is not a gyre msgpack record stream") from None
                end, torn = scan.end, scan.torn
                if torn:
                    side = _keep_torn(path, mm[end:], end)
                    log.warning(
                        "%s: its last frame is torn (%d bytes at byte %d, a crash mid-append); "
                        "moved to %s, appending after frame %d",
                        path,
                        torn,
                        end,
                        side,
                        scan.frames,
                    )
            if torn:
                os.ftruncate(fd, end)
                os.fsync(fd)
        if end == 0:  # new, or torn inside its magic
            os.ftruncate(fd, 0)
            os.write(fd, MAGIC)
            os.fsync(fd)
            _fsync_dir(path.parent)
            end = len(MAGIC)
        return fd, end, torn
    except BaseException:
        os.close(fd)
        raise


class Ticket:
    """A queued record's fate, readable from any thread without waking an event loop: `settled` once the
    record is on disk (`error` None) or could not be written (`error` says why). The writer thread sets
    `error` before `settled`."""

    __slots__ = ("error", "settled")

    def __init__(self) -> None:
        self.settled = False
        self.error: RecordWriteFailed | None = None


Item = tuple[Call, asyncio.AbstractEventLoop, asyncio.Future[None], Ticket]


class RecordSink:
    """One writer thread owns the log file and the PUSH socket; callers await `write`."""

    def __init__(
        self,
        log_path: str | os.PathLike[str] | None,
        push_endpoint: str = "",
        hwm: int = 10000,
        token: str = "",
    ) -> None:
        """`token`: the run token for the PUSH ("" reads $GYRE_TOKEN; none: plain loopback)."""
        self.path = Path(log_path) if log_path else None
        self.stats = SinkStats()
        self._q: queue.Queue[Item | None] = queue.Queue()
        self._fd = -1
        self._end = 0
        self._broken: str = ""  # why the log cannot be appended to any more (a partial frame stuck)
        if self.path is not None:
            self._fd, self._end, self.stats.torn_bytes_moved = open_log(self.path)
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._push: zmq.Socket[bytes] | None = None
        if push_endpoint:
            self._ctx = zmq.Context()
            self._push = self._ctx.socket(zmq.PUSH)
            self._push.setsockopt(zmq.SNDHWM, hwm)
            self._push.setsockopt(zmq.LINGER, 2000)
            sockets.connect(self._push, push_endpoint, token)
        self._thread = threading.Thread(
            target=run_or_die, args=(self._run, "record writer"), name="gyre-proxy-sink", daemon=True
        )
        self._thread.start()

    def submit(self, rec: Call) -> asyncio.Future[None]:
        """Queue `rec` now; the future is done once it is on disk, or fails with `RecordWriteFailed` if it
        could not be written (then it is not in the log). Cancelling the future does not unqueue it."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self.submit_for(rec, loop, fut)
        return fut

    def submit_for(self, rec: Call, loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None]) -> Ticket:
        """`submit` from any thread: `fut` (a future of `loop`) is resolved on `loop` as `submit`'s is. The
        ticket says the same sooner: resolving `fut` takes `loop` a turn or two once the record is written
        (a wake-up from this thread, then the waiting task's), and a busy loop's turns are long."""
        ticket = Ticket()
        self._q.put((rec, loop, fut, ticket))
        return ticket

    async def write(self, rec: Call) -> None:
        """Returns once `rec` is on disk (see `submit`)."""
        await self.submit(rec)

    def _next_batch(self) -> tuple[list[Item], bool]:
        """Everything waiting now (at least one item), and whether `close` asked the thread to stop."""
        item = self._q.get()
        if item is None:
            return [], True
        batch = [item]
        while True:
            try:
                nxt = self._q.get_nowait()
            except queue.Empty:
                return batch, False
            if nxt is None:
                return batch, True
            batch.append(nxt)

    def _run(self) -> None:
        codec = Codec()
        while True:
            batch, stop = self._next_batch()
            if batch:
                error: RecordWriteFailed | None
                try:
                    payloads = [codec.encode_msgpack(rec) for rec, _, _, _ in batch]
                except Exception as exc:  # a record that cannot be encoded fails its batch, not the proxy
                    log.exception("encoding %d records failed", len(batch))
                    payloads, error = [], RecordWriteFailed(f"a record could not be encoded: {exc}")
                else:
                    error = self._append(payloads)
                # the tickets first (callers that poll them need no wake-up), then one wake-up per
                # event loop for the whole batch (each `call_soon_threadsafe` writes to the loop's
                # self-pipe and is one more callback in the loop's turn)
                by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Future[None]]] = {}
                for _, loop, fut, ticket in batch:
                    ticket.error = None if error is None else RecordWriteFailed(str(error))
                    ticket.settled = True
                    by_loop.setdefault(loop, []).append(fut)
                for loop, futs in by_loop.items():
                    with contextlib.suppress(RuntimeError):  # that loop has closed: nobody is waiting
                        loop.call_soon_threadsafe(_resolve_all, futs, error)
                if error is None:
                    self._send(payloads)
            if stop:
                return

    def _append(self, payloads: list[bytes]) -> RecordWriteFailed | None:
        """Write the frames and fsync; on failure cut the log back to where it ended (None: written)."""
        n = len(payloads)
        if self._fd < 0:
            self.stats.written += n
            return None
        if self._broken:
            self.stats.write_failures += n
            return RecordWriteFailed(self._broken)
        data = b"".join(_FRAME.pack(len(p)) + p for p in payloads)
        start = self._end
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
            os.fsync(self._fd)
        except OSError as exc:
            self.stats.write_failures += n
            log.error(
                "writing %d records to %s failed: %s; cutting the log back to %d bytes",
                n,
                self.path,
                exc,
                start,
            )
            self._cut_back(start)
            return RecordWriteFailed(f"the record log could not be written: {exc}")
        self._end = start + len(data)
        self.stats.written += n
        self.stats.fsyncs += 1
        return None

    def _cut_back(self, length: int) -> None:
        try:
            os.ftruncate(self._fd, length)
        except OSError as exc:
            self._broken = (
                f"the record log {self.path} holds a partial frame that could not be cut off ({exc}); "
                "restart the proxy (opening the log moves a torn tail aside)"
            )
            log.error("%s", self._broken)
            return
        with contextlib.suppress(OSError):  # the cut is in the page cache; a later fsync persists it
            os.fsync(self._fd)

    def _send(self, payloads: list[bytes]) -> None:
        if self._push is None:
            return
        for p in payloads:
            try:
                self._push.send(p, zmq.NOBLOCK)
                self.stats.pushed += 1
            except zmq.Again:
                self.stats.push_dropped += 1

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(10.0)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._push is not None:
            self._push.close()
        if self._ctx is not None:
            self._ctx.term()


def _resolve_all(futs: list[asyncio.Future[None]], error: Exception | None) -> None:
    for fut in futs:
        if fut.done():
            continue
        if error is None:
            fut.set_result(None)
        else:
            fut.set_exception(RecordWriteFailed(str(error)))  # one exception object per waiting call
