"""Same-host shared memory behind the `Transport` API: regions are POSIX shared-memory segments that
peers on this host map by name, and a transfer is a memcpy between mappings (no sockets, no copies in between).

Only memory from `alloc` can be read or written by peers; `register` wraps any local CPU buffer as a
source or destination of this process's own reads and writes. Segments are files under /dev/shm (Linux),
unlinked on `close`; a mapping lives as long as a numpy view of it does.

A batch of `COPY_THREADED_MIN_BYTES` or more is copied on `Config.copy_threads` threads (the calling
thread and a pool of helpers, started on first use and stopped by `close`): its ops are cut into pieces of
`COPY_PIECE_BYTES` that the threads take in turn. Smaller batches are copied on the calling thread.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import itertools
import mmap
import os
import secrets
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from .api import BatchResult, Config, EntryStatus, Op, Region, check_ranges
from .buffers import view_of
from .errors import PeerGoneError, TransportUnavailableError, XferError
from .protocol import RegionDesc, TransportKind


def _host_tag() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    return f"shm:{os.uname().nodename}:{boot}"


class ShmTransport:
    """Shared-memory transport for processes on one host (the endpoint names the host and boot)."""

    kind = TransportKind.SHM

    def __init__(self, config: Config) -> None:
        self.config = config
        self._endpoint = _host_tag()
        self.incarnation = secrets.token_hex(8)
        self._prefix = f"gyre-{os.getpid()}-{self.incarnation[:8]}"
        self._ids = itertools.count(1)
        self._owned: dict[int, str] = {}
        atexit.register(_unlink_all, self._owned)  # a normal exit never leaves segments behind
        self._regions: dict[int, Region] = {}
        self._peers: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._copiers: ThreadPoolExecutor | None = None  # helper threads for large batches, made on first use

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def alloc(self, nbytes: int) -> Region:
        rid = next(self._ids)
        name = f"{self._prefix}-{rid}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, max(nbytes, 1))
            arr = _map(fd, max(nbytes, 1))  # a new segment reads as zeros
        finally:
            os.close(fd)
        region = Region(RegionDesc(rid, nbytes, arr.ctypes.data, name), "cpu", arr, arr)
        with self._lock:
            self._owned[rid] = path
            self._regions[rid] = region
        return region

    def register(self, buf: Any) -> Region:
        view = view_of(buf)
        if view.device != "cpu":
            raise TransportUnavailableError("the shared-memory transport moves CPU memory only")
        if view.nbytes:
            arr = np.ctypeslib.as_array((ctypes.c_uint8 * view.nbytes).from_address(view.addr))
        else:
            arr = np.empty(0, np.uint8)
        region = Region(RegionDesc(next(self._ids), view.nbytes, view.addr, ""), "cpu", arr, buf)
        with self._lock:
            self._regions[region.desc.region_id] = region
        return region

    def unregister(self, region: Region) -> None:
        with self._lock:
            self._regions.pop(region.desc.region_id, None)
            path = self._owned.pop(region.desc.region_id, None)
        if path is not None:
            _unlink(path)

    def _peer_map(self, desc: RegionDesc) -> np.ndarray:
        """The peer region mapped into this process: mapped once, cached by name (the `PEER_MAPPINGS`
        most recently used; see `_drop_gone` for segments their owner removed)."""
        if not desc.shm_name:
            raise XferError(
                f"peer region {desc.region_id} is not in shared memory (it was registered, not allocated)"
            )
        if "/" in desc.shm_name or not desc.shm_name.startswith("gyre-"):
            raise XferError(f"{desc.shm_name!r} is not a gyre shared-memory segment")
        with self._lock:
            arr = self._peers.pop(desc.shm_name, None)
            if arr is None:
                try:
                    fd = os.open(os.path.join(SHM_DIR, desc.shm_name), os.O_RDWR)
                except FileNotFoundError:
                    raise
                except OSError as e:
                    raise XferError(f"cannot map peer segment {desc.shm_name}: {e}") from e
                try:
                    arr = _map(fd, os.fstat(fd).st_size)
                except (OSError, ValueError) as e:  # empty, not mappable
                    raise XferError(f"cannot map peer segment {desc.shm_name}: {e}") from e
                finally:
                    os.close(fd)
            self._peers[desc.shm_name] = arr  # most recently used last
            while len(self._peers) > PEER_MAPPINGS:
                self._peers.pop(next(iter(self._peers)))  # unmapped once no batch holds it
        if arr.nbytes < desc.nbytes:
            raise XferError(
                f"peer segment {desc.shm_name} is {arr.nbytes} bytes, descriptor says {desc.nbytes}"
            )
        return arr

    def _drop_gone(self) -> None:
        """Drop cached mappings of segments their owner removed (once per batch or `map_peer`, hits
        included: a reader that keeps reading one reused segment would otherwise hold freed memory)."""
        with self._lock:
            gone = [k for k in self._peers if not os.path.exists(os.path.join(SHM_DIR, k))]
            for name in gone:
                del self._peers[name]  # unmapped once no batch or view holds it

    def map_peer(self, desc: RegionDesc) -> np.ndarray:
        """A uint8 view of a peer's allocated region, read in place (no copy); it stays mapped as long as
        the view lives. Raises PeerGoneError when the segment no longer exists, XferError when it is not a
        gyre segment or is shorter than `desc` says."""
        self._drop_gone()
        try:
            return self._peer_map(desc)[: desc.nbytes]
        except FileNotFoundError as e:
            raise PeerGoneError(f"peer segment {desc.shm_name} no longer exists") from e

    def read(self, peer: str, ops: Sequence[Op], timeout_s: float | None = None) -> BatchResult:
        return self._batch(peer, ops, into_local=True)

    def write(self, peer: str, ops: Sequence[Op], timeout_s: float | None = None) -> BatchResult:
        return self._batch(peer, ops, into_local=False)

    def _batch(self, peer: str, ops: Sequence[Op], into_local: bool) -> BatchResult:
        if self._closed:
            raise XferError("transport is closed")
        t0 = time.monotonic()
        if peer != self._endpoint:
            return BatchResult(
                tuple(EntryStatus.FAILED for _ in ops),
                0.0,
                f"peer {peer} is not on this host ({self._endpoint})",
            )
        self._drop_gone()
        problems = check_ranges(ops)
        statuses: list[EntryStatus] = []
        details = [p for p in problems if p]
        held = []  # the peer mappings this batch uses stay mapped until it ends
        copies: list[tuple[int, int, int, int]] = []  # (entry, destination, source, length)
        for i, (op, problem) in enumerate(zip(ops, problems, strict=True)):
            if problem:
                statuses.append(EntryStatus.OUT_OF_RANGE)
                continue
            try:
                peer_arr = self._peer_map(op.remote)
            except FileNotFoundError:
                statuses.append(EntryStatus.PEER_GONE)
                details.append(f"peer segment {op.remote.shm_name} no longer exists")
                continue
            except XferError as e:
                statuses.append(EntryStatus.FAILED)
                details.append(str(e))
                continue
            held.append(peer_arr)
            local = op.region.addr + op.local_offset
            remote = int(peer_arr.ctypes.data) + op.remote_offset
            copies.append((i, local, remote, op.length) if into_local else (i, remote, local, op.length))
            statuses.append(EntryStatus.OK)
        threads = self.config.copy_threads
        if threads > 1 and sum(c[3] for c in copies) >= COPY_THREADED_MIN_BYTES:
            for i, why in self._copy_threaded(copies, threads):
                statuses[i] = EntryStatus.FAILED
                details.append(f"entry {i}: {why}")
        else:
            for _, dst, src, n in copies:
                _memmove(dst, src, n)
        return BatchResult(tuple(statuses), time.monotonic() - t0, "; ".join(details))

    def _copy_threaded(self, copies: list[tuple[int, int, int, int]], threads: int) -> list[tuple[int, str]]:
        """Copy `copies` in pieces of `COPY_PIECE_BYTES` on this thread and up to `threads - 1` helpers,
        each taking the next piece until none is left. Returns (entry, why) for each entry whose copy
        raised, in entry order; returns (or raises) only once no helper touches the memory any more."""
        pieces = _pieces(copies, COPY_PIECE_BYTES)
        turns = itertools.count()
        stop = threading.Event()
        failed: dict[int, str] = {}

        def drain() -> None:
            while not stop.is_set() and (k := next(turns)) < len(pieces):
                entry, dst, src, n = pieces[k]
                try:
                    _memmove(dst, src, n)
                except Exception as e:  # the entry's FAILED status says so
                    failed.setdefault(entry, f"copy failed: {type(e).__name__}: {e}")

        helpers: list[Future[None]] = []
        try:
            pool = self._copy_pool(threads - 1)
            if pool is not None:
                for _ in range(min(threads - 1, len(pieces) - 1)):
                    try:
                        helpers.append(pool.submit(drain))
                    except RuntimeError:  # closed meanwhile: this thread copies the rest
                        break
            drain()
        except BaseException:
            stop.set()  # helpers stop after their current piece
            raise
        finally:
            for f in helpers:
                f.cancel()  # not started yet (the pool busy with another batch): nothing left for it
            wait(helpers)  # the mappings `_batch` holds outlive every helper's last memmove
        for f in helpers:
            if not f.cancelled() and (exc := f.exception()) is not None:  # not from a memmove: fail them all
                for entry, *_ in copies:
                    failed.setdefault(entry, f"copy thread failed: {type(exc).__name__}: {exc}")
        return sorted(failed.items())

    def _copy_pool(self, helpers: int) -> ThreadPoolExecutor | None:
        """The helper threads (made on first use); None once the transport is closed."""
        with self._lock:
            if self._copiers is None and not self._closed and helpers > 0:
                self._copiers = ThreadPoolExecutor(max_workers=helpers, thread_name_prefix="gyre-xfer-copy")
            return self._copiers

    def note_peer(self, peer: str, incarnation: str) -> None:
        """Nothing to do: a restarted peer's segments have new names."""

    def forget_peer(self, shm_name: str) -> None:
        """Drop a cached mapping (after the peer restarted, its segments have new names)."""
        with self._lock:
            self._peers.pop(shm_name, None)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            copiers, self._copiers = self._copiers, None
            owned = list(self._owned.values())
            self._owned.clear()
            self._peers.clear()
            self._regions.clear()
        if copiers is not None:
            copiers.shutdown(wait=True)  # a batch still running on another thread finishes its pieces
        for path in owned:
            _unlink(path)


def sweep_orphans(shm_dir: str | None = None) -> list[str]:
    """Remove gyre segments whose creating process is gone (killed before it could unlink them).
    Judged by pid in this pid namespace: do not run it where containers with other pid namespaces share
    /dev/shm. Returns the paths removed."""
    shm_dir = shm_dir or SHM_DIR
    removed = []
    for name in os.listdir(shm_dir):
        parts = name.split("-")
        if len(parts) < 4 or parts[0] != "gyre" or not parts[1].isdigit():
            continue
        try:
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:
            _unlink(os.path.join(shm_dir, name))
            removed.append(os.path.join(shm_dir, name))
        except PermissionError:
            continue  # alive, owned by someone else
    return removed


SHM_DIR = "/dev/shm"
PEER_MAPPINGS = 16
"""How many peer segments stay mapped for later batches (a segment a peer hands out again, such as a
reused KV offer arena, is then read without mapping and faulting it in again)."""


_memmove = ctypes.memmove  # releases the GIL while it copies

COPY_PIECE_BYTES = 16 << 20
"""Piece size of a threaded batch: each op longer than this is copied as several pieces on several threads."""
COPY_THREADED_MIN_BYTES = 64 << 20
"""Batches moving fewer bytes are copied on the calling thread (handing pieces to helpers costs more than
it saves)."""


def _pieces(copies: Sequence[tuple[int, int, int, int]], piece: int) -> list[tuple[int, int, int, int]]:
    """(entry, destination, source, length) cut into pieces of at most `piece` bytes, in order."""
    out = []
    for entry, dst, src, n in copies:
        for pos in range(0, n, piece):
            out.append((entry, dst + pos, src + pos, min(piece, n - pos)))
    return out


def _map(fd: int, nbytes: int) -> np.ndarray:
    """uint8 view of a shared read-write mapping of `fd`, its pages faulted in by one call (MAP_POPULATE)
    rather than one fault per 4 KiB page on first touch; the mapping lives as long as the view does."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return np.frombuffer(mmap.mmap(fd, nbytes, flags=flags), dtype=np.uint8)


def _unlink_all(owned: dict[int, str]) -> None:
    for path in list(owned.values()):
        _unlink(path)
    owned.clear()


def _unlink(path: str) -> None:
    """Remove the segment's name; processes that mapped it keep their mapping until they drop it."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
