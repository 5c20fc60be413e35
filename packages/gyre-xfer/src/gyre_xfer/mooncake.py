"""Mooncake Transfer Engine behind the `Transport` API: TCP here, RDMA where the machine has it.

Every call runs on a helper thread and is waited for with a deadline, so a hung peer is a TIMEOUT, not a
hang; Mooncake's bare -1 is classified (peer port refusing connections = PEER_GONE, no progress for the
configured time = TIMEOUT, otherwise entries are retried one by one so the result says which arrived).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import itertools
import json
import os
import queue
import secrets
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .api import BatchResult, Config, EntryStatus, Op, Region, check_ranges
from .buffers import view_of
from .errors import TransferFailedError, TransportUnavailableError, XferError
from .protocol import RegionDesc, TransportKind

# shared library -> Debian package that provides it
_SYSTEM_LIBS = {"libibverbs.so.1": "libibverbs1", "librdmacm.so.1": "librdmacm1", "libnuma.so.1": "libnuma1"}
_WHEELS = ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine-cuda13", "mooncake-transfer-engine")


def installed_wheel() -> str | None:
    """Which Mooncake distribution is installed (they all provide the same `mooncake` module)."""
    for name in _WHEELS:
        try:
            importlib.metadata.version(name)
            return name
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def load_engine_class(log_level: int = 2) -> Any:
    """Import `mooncake.engine.TransferEngine`, or raise TransportUnavailableError saying what to install."""
    os.environ.setdefault("GLOG_minloglevel", str(log_level))
    try:
        from mooncake.engine import TransferEngine
    except ModuleNotFoundError as e:
        if e.name is not None and e.name.startswith("mooncake"):
            raise TransportUnavailableError(
                "Mooncake Transfer Engine is not installed: pip install 'gyre-xfer[mooncake]' on CPU "
                "machines, or 'gyre-xfer[mooncake-cuda13]' on CUDA 13 GPU machines (pick one: both "
                "provide the same `mooncake` module)"
            ) from e
        raise TransportUnavailableError(f"mooncake failed to import: {e}") from e
    except ImportError as e:
        msg = str(e)
        for lib, pkg in _SYSTEM_LIBS.items():
            if lib in msg:
                raise TransportUnavailableError(
                    f"Mooncake Transfer Engine needs Debian's {pkg} (the system library {lib}), even "
                    f"over TCP: apt-get install -y {pkg}   (Debian/Ubuntu, as root). ({msg})"
                ) from e
        raise TransportUnavailableError(f"mooncake failed to import: {msg}") from e
    return TransferEngine


@functools.cache
def unavailable_reason() -> str | None:
    """None when Mooncake Transfer Engine loads in this process, else why not (what to install), as
    `load_engine_class` would raise it. Asked once per process: a library installed later needs a new one."""
    try:
        load_engine_class()
    except TransportUnavailableError as e:
        return str(e)
    return None


def _probe(peer: str, timeout_s: float) -> bool | None:
    """True if the peer's handshake port accepts a TCP connection, False if refused, None if unknown."""
    host, sep, port = peer.rpartition(":")
    if not sep or not port.isdigit():
        return None
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except ConnectionRefusedError:
        return False
    except OSError:
        return None


def rpc_address(metadata_url: str, name: str, timeout_s: float = 1.0) -> str | None:
    """The `host:port` where the process registered as `name` takes handshakes, read from Mooncake's HTTP
    metadata server ("" when nothing is registered under that name, None when the server cannot say)."""
    key = urllib.parse.quote(f"mooncake/rpc_meta/{name}", safe="")
    try:
        with urllib.request.urlopen(f"{metadata_url}?key={key}", timeout=timeout_s) as r:
            meta = json.loads(r.read())
        return f"{meta['ip_or_host_name']}:{int(meta['rpc_port'])}"
    except urllib.error.HTTPError as e:
        return "" if e.code == 404 else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def clear_stale_registration(metadata_url: str, name: str, probe_timeout_s: float = 1.0) -> bool:
    """Delete a dead process's keys (`mooncake/rpc_meta/<name>`, `mooncake/ram/<name>`) from Mooncake's
    HTTP metadata server. Refuses (returns False) while the registered handshake port still accepts connections."""
    addr = rpc_address(metadata_url, name, probe_timeout_s)
    if addr is None or (addr and _probe(addr, probe_timeout_s) is not False):
        return False
    for key in (f"mooncake/rpc_meta/{name}", f"mooncake/ram/{name}"):
        url = f"{metadata_url}?key={urllib.parse.quote(key, safe='')}"
        req = urllib.request.Request(url, method="DELETE")
        try:
            with urllib.request.urlopen(req, timeout=probe_timeout_s * 5):
                pass
        except urllib.error.HTTPError as e:
            if e.code != 404:
                return False
        except OSError:
            return False
    return True


class MooncakeTransport:
    """One Mooncake TransferEngine for this process; see `Config` for its settings."""

    kind = TransportKind.MOONCAKE

    def __init__(self, config: Config) -> None:
        self.config = config
        engine_cls = load_engine_class(config.log_level)
        # Mooncake reads these when a connection is made; process-wide, so the last transport opened wins.
        os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"] = str(config.progress_timeout_s)
        os.environ["MC_TCP_STATUS_TIMEOUT_SEC"] = str(config.progress_timeout_s)
        self._engine: Any = self._start(engine_cls)
        if config.metadata_server == "P2PHANDSHAKE":
            self._endpoint = f"{config.hostname}:{self._engine.get_rpc_port()}"
        else:
            self._endpoint = config.hostname
        self._ids = itertools.count(1)
        self._regions: dict[int, Region] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._helpers = _Helpers()
        self.incarnation = secrets.token_hex(8)
        self._incarnations: dict[str, str] = {}
        self.reopens = 0
        self.abandoned_calls = 0
        """Calls that outlived their deadline; their buffers stay referenced until they return."""

    def _start(self, engine_cls: Any) -> Any:
        config = self.config
        engine = engine_cls()
        rc = engine.initialize(config.hostname, config.metadata_server, config.protocol, config.device_name)
        # A process killed under this name left its keys on the metadata server, and Mooncake refuses
        # to register over them: if nothing answers at that name any more, drop them and try again.
        if (
            rc != 0
            and config.metadata_server.startswith(("http://", "https://"))
            and clear_stale_registration(config.metadata_server, config.hostname, config.probe_timeout_s)
        ):
            engine = engine_cls()
            rc = engine.initialize(
                config.hostname, config.metadata_server, config.protocol, config.device_name
            )
        if rc != 0:
            raise TransportUnavailableError(
                f"Mooncake initialize({config.hostname!r}, {config.metadata_server!r}, "
                f"{config.protocol!r}) returned {rc}; see its log on stderr"
            )
        return engine

    @property
    def endpoint(self) -> str:
        return self._endpoint

    @property
    def engine(self) -> Any:
        """The raw mooncake TransferEngine (for the benchmark's side-by-side figures)."""
        return self._engine

    @property
    def rpc_port(self) -> int:
        return int(self._engine.get_rpc_port())

    # ---- memory -----------------------------------------------------------------------------------

    def alloc(self, nbytes: int) -> Region:
        arr = np.empty(max(nbytes, 1), dtype=np.uint8)
        arr.fill(0)  # fault the pages in now, not during the first transfer
        return self.register(arr)

    def register(self, buf: Any) -> Region:
        view = view_of(buf)
        if view.device.startswith("cuda") and installed_wheel() == "mooncake-transfer-engine-non-cuda":
            raise TransportUnavailableError(
                "registering CUDA memory needs the CUDA Mooncake wheel: pip install 'gyre-xfer[mooncake-cuda13]'"
            )
        location = "cpu" if view.device == "cpu" else view.device
        rc = self._engine.register_memory(view.addr, view.nbytes, location) if view.nbytes else 0
        if rc != 0:
            raise TransferFailedError(f"Mooncake register_memory({view.nbytes} bytes) returned {rc}")
        arr: np.ndarray | None = None
        if view.device == "cpu" and view.nbytes == 0:
            arr = np.empty(0, np.uint8)
        elif view.device == "cpu":
            arr = np.ctypeslib.as_array((ctypes.c_uint8 * view.nbytes).from_address(view.addr))
        region = Region(RegionDesc(next(self._ids), view.nbytes, view.addr), view.device, arr, buf)
        with self._lock:
            self._regions[region.desc.region_id] = region
        return region

    def unregister(self, region: Region) -> None:
        with self._lock:
            if self._regions.pop(region.desc.region_id, None) is None:
                return
        if region.nbytes:
            self._engine.unregister_memory(region.addr)

    # ---- transfers --------------------------------------------------------------------------------

    def read(self, peer: str, ops: Sequence[Op], timeout_s: float | None = None) -> BatchResult:
        return self._batch(peer, ops, timeout_s, self._engine.batch_transfer_sync_read)

    def write(self, peer: str, ops: Sequence[Op], timeout_s: float | None = None) -> BatchResult:
        return self._batch(peer, ops, timeout_s, self._engine.batch_transfer_sync_write)

    def _call(
        self, fn: Callable[..., int], args: tuple[Any, ...], keep: object, deadline: float
    ) -> int | None:
        """Run fn(*args) on a helper thread; its return code, or None if the deadline passed first.
        `keep` (the buffers involved) stays referenced by the helper until Mooncake returns."""
        call = _Call(fn, args, keep, 2.0 * self.config.progress_timeout_s + 5.0)
        self._helpers.submit(call)
        if not call.done.wait(max(0.0, deadline - time.monotonic())):
            self.abandoned_calls += 1
            return None
        return call.rc

    def _batch(
        self, peer: str, ops: Sequence[Op], timeout_s: float | None, fn: Callable[..., int]
    ) -> BatchResult:
        if self._closed:
            raise XferError("transport is closed")
        t0 = time.monotonic()
        deadline = t0 + (self.config.timeout_s if timeout_s is None else timeout_s)
        problems = check_ranges(ops)
        statuses = [EntryStatus.OUT_OF_RANGE if p else EntryStatus.NOT_ATTEMPTED for p in problems]
        detail = "; ".join(p for p in problems if p)
        live = [i for i, p in enumerate(problems) if p is None and ops[i].length > 0]
        for i, op in enumerate(ops):
            if problems[i] is None and op.length == 0:
                statuses[i] = EntryStatus.OK
        if live:
            rc = self._submit(peer, [ops[i] for i in live], fn, deadline)
            if rc == 0:
                for i in live:
                    statuses[i] = EntryStatus.OK
            else:
                why = self._classify(peer, rc, t0)
                if why is EntryStatus.FAILED and len(live) > 1:
                    # Mooncake fails a batch whole; retry entry by entry to learn which ones arrive.
                    for i in live:
                        if time.monotonic() >= deadline:
                            statuses[i] = EntryStatus.TIMEOUT
                            continue
                        r = self._submit(peer, [ops[i]], fn, deadline)
                        statuses[i] = EntryStatus.OK if r == 0 else self._classify(peer, r, t0)
                else:
                    for i in live:
                        statuses[i] = why
                detail = "; ".join(x for x in (detail, f"mooncake returned {rc} from {peer}") if x)
        return BatchResult(tuple(statuses), time.monotonic() - t0, detail)

    def _submit(self, peer: str, ops: Sequence[Op], fn: Callable[..., int], deadline: float) -> int | None:
        local = [op.region.addr + op.local_offset for op in ops]
        remote = [op.remote.addr + op.remote_offset for op in ops]
        lengths = [op.length for op in ops]
        return self._call(fn, (peer, local, remote, lengths), [op.region for op in ops], deadline)

    def _classify(self, peer: str, rc: int | None, t0: float) -> EntryStatus:
        if rc is None:
            return EntryStatus.TIMEOUT
        alive = self._alive(peer)
        if alive is False:
            return EntryStatus.PEER_GONE
        if time.monotonic() - t0 >= 0.9 * self.config.progress_timeout_s:
            return EntryStatus.TIMEOUT
        return EntryStatus.FAILED

    def _alive(self, peer: str) -> bool | None:
        """Does the peer's handshake port accept connections? (None: cannot tell.)"""
        t = self.config.probe_timeout_s
        if self.config.metadata_server == "P2PHANDSHAKE":
            return _probe(peer, t)
        if self.config.metadata_server.startswith(("http://", "https://")):
            addr = rpc_address(self.config.metadata_server, peer, t)
            return None if addr is None else (False if addr == "" else _probe(addr, t))
        return None  # etcd and others: not looked up

    def note_peer(self, peer: str, incarnation: str) -> None:
        """Tell the transport which incarnation of `peer` is current. With a metadata server a restarted
        peer comes back under the same name, but Mooncake keeps the old process's address for it: a new
        incarnation then rebuilds this process's engine (`reopen`)."""
        last = self._incarnations.get(peer)
        self._incarnations[peer] = incarnation
        if last is not None and last != incarnation and self.config.metadata_server != "P2PHANDSHAKE":
            self.reopen()

    def reopen(self) -> None:
        """Replace this process's Mooncake engine with a fresh one (forgetting every cached peer address)
        and register the same regions again, at the same addresses. Transfers in flight on other threads fail."""
        with self._lock:
            regions = list(self._regions.values())
        for r in regions:
            if r.nbytes:
                self._engine.unregister_memory(r.addr)
        self._engine = None  # the destructor withdraws this process's keys from the metadata server
        try:
            self._engine = self._start(load_engine_class(self.config.log_level))
        except TransportUnavailableError:
            self._closed = True
            raise
        for r in regions:
            if r.nbytes:
                location = "cpu" if r.device == "cpu" else r.device
                if self._engine.register_memory(r.addr, r.nbytes, location) != 0:
                    raise TransferFailedError(f"re-registering region {r.desc.region_id} failed after reopen")
        self.reopens += 1

    def close(self) -> None:
        """Unregister every region. Mooncake's engine itself lives until the process exits."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            regions, self._regions = list(self._regions.values()), {}
        for r in regions:
            if r.nbytes and self._engine is not None:
                self._engine.unregister_memory(r.addr)
        self._engine = None  # Mooncake stops its listeners when the engine is destroyed


class _Call:
    __slots__ = ("args", "done", "fn", "grace_s", "keep", "rc")

    def __init__(self, fn: Callable[..., int], args: tuple[Any, ...], keep: object, grace_s: float) -> None:
        self.fn, self.args, self.keep, self.grace_s = fn, args, keep, grace_s
        self.rc = -1
        self.done = threading.Event()

    def run(self) -> None:
        try:
            self.rc = int(self.fn(*self.args))
        except Exception:  # a pybind error is a failed transfer, reported as -1
            self.rc = -1
        finally:
            if self.rc != 0:
                # Mooncake returns at the first failed slice while other slices of the batch may still
                # be landing in these buffers: keep them alive a while longer.
                _QUARANTINE.hold(self.keep, self.grace_s)
            self.keep = self.fn = self.args = None  # type: ignore[assignment]  # let the engine go
            self.done.set()


class _Quarantine:
    """Buffers of failed transfers, kept referenced (process-wide) until Mooncake is done with them."""

    def __init__(self) -> None:
        self._held: list[tuple[float, object]] = []
        self._lock = threading.Lock()

    def hold(self, obj: object, seconds: float) -> None:
        now = time.monotonic()
        with self._lock:
            self._held = [(t, o) for t, o in self._held if t > now]
            self._held.append((now + seconds, obj))


_QUARANTINE = _Quarantine()


class _Helpers:
    """Daemon threads that make Mooncake's blocking calls. A call stuck past its deadline keeps its
    thread; the next call starts a new one, so a hung peer never blocks other transfers or exit."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, call: _Call) -> None:
        with self._lock:
            if self._idle == 0:
                threading.Thread(target=self._loop, name="gyre-xfer-mooncake", daemon=True).start()
            else:
                self._idle -= 1
        self._queue.put(call)

    def _loop(self) -> None:
        while True:
            call = self._queue.get()
            call.run()
            del call
            with self._lock:
                self._idle += 1
