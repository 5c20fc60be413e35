"""The one API over both transports (their types, defined here so that each transport can import them
while `transport.open_transport` imports the transports): register memory, describe it to peers, and move
batches of byte ranges between local regions and a peer's regions, with a deadline and a result per entry.
Both transports check every range before any byte moves and raise or report typed errors.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .errors import OutOfRangeError, PeerGoneError, PeerTimeoutError, TransferFailedError
from .protocol import RegionDesc, TransportKind


class EntryStatus(enum.IntEnum):
    """What happened to one entry of a batch."""

    OK = 0
    OUT_OF_RANGE = 1
    PEER_GONE = 2
    TIMEOUT = 3
    FAILED = 4
    NOT_ATTEMPTED = 5


@dataclass(frozen=True, slots=True)
class Region:
    """Memory this process registered. `array` is a uint8 view of it on the CPU (None for device memory)."""

    desc: RegionDesc
    device: str
    array: np.ndarray | None
    owner: object = field(repr=False, compare=False)

    @property
    def addr(self) -> int:
        return self.desc.addr

    @property
    def nbytes(self) -> int:
        return self.desc.nbytes


@dataclass(frozen=True, slots=True)
class Op:
    """Move `length` bytes between local `region[local_offset:]` and the peer's `remote[remote_offset:]`."""

    region: Region
    local_offset: int
    remote: RegionDesc
    remote_offset: int
    length: int


@dataclass(frozen=True, slots=True)
class BatchResult:
    """Per-entry outcome of one batch, in the order the entries were given."""

    statuses: tuple[EntryStatus, ...]
    elapsed_s: float
    detail: str = ""

    @property
    def ok(self) -> bool:
        return all(s is EntryStatus.OK for s in self.statuses)

    def failed(self) -> list[int]:
        return [i for i, s in enumerate(self.statuses) if s is not EntryStatus.OK]

    def raise_for_status(self, peer: str, what: str) -> None:
        """Raise the typed error of the worst failing entry (peer gone > timeout > range > other)."""
        if self.ok:
            return
        bad = self.failed()
        kinds = {self.statuses[i] for i in bad}
        msg = (
            f"{what} from {peer}: {len(bad)} of {len(self.statuses)} entries failed after "
            f"{self.elapsed_s:.2f} s ({', '.join(sorted(k.name for k in kinds))})"
            + (f": {self.detail}" if self.detail else "")
        )
        if EntryStatus.PEER_GONE in kinds:
            raise PeerGoneError(msg)
        if EntryStatus.TIMEOUT in kinds:
            raise PeerTimeoutError(msg)
        if EntryStatus.OUT_OF_RANGE in kinds:
            raise OutOfRangeError(msg)
        raise TransferFailedError(msg)


class Transport(Protocol):
    """What both transports offer. Reads pull peer bytes into local regions; writes push local bytes out."""

    kind: TransportKind
    incarnation: str
    """Random per opened transport: tells a restarted process from its predecessor at the same endpoint."""

    @property
    def endpoint(self) -> str:
        """How peers name this process (a Mooncake segment name, or the shared-memory host tag)."""
        ...

    def alloc(self, nbytes: int) -> Region:
        """Allocate and register `nbytes` of CPU memory that peers may read or write."""
        ...

    def register(self, buf: Any) -> Region:
        """Register an existing numpy array or torch tensor (C-contiguous)."""
        ...

    def unregister(self, region: Region) -> None: ...

    def note_peer(self, peer: str, incarnation: str) -> None:
        """Record which incarnation of a peer is current, so state cached about an older one is dropped."""
        ...

    def read(self, peer: str, ops: Sequence[Op], timeout_s: float | None = None) -> BatchResult: ...

    def write(self, peer: str, ops: Sequence[Op], timeout_s: float | None = None) -> BatchResult: ...

    def close(self) -> None: ...


def check_ranges(ops: Sequence[Op]) -> list[str | None]:
    """For each op, None if both ranges lie inside their regions, else why not."""
    out: list[str | None] = []
    for i, op in enumerate(ops):
        if op.length < 0 or op.local_offset < 0 or op.remote_offset < 0:
            out.append(f"entry {i}: negative offset or length")
        elif op.local_offset + op.length > op.region.nbytes:
            out.append(
                f"entry {i}: local [{op.local_offset}, {op.local_offset + op.length}) "
                f"exceeds region {op.region.desc.region_id} of {op.region.nbytes} bytes"
            )
        elif op.remote_offset + op.length > op.remote.nbytes:
            out.append(
                f"entry {i}: remote [{op.remote_offset}, {op.remote_offset + op.length}) "
                f"exceeds peer region {op.remote.region_id} of {op.remote.nbytes} bytes"
            )
        else:
            out.append(None)
    return out


@dataclass(frozen=True)
class Config:
    """How to open a transport. Field docs are the command-line help."""

    kind: str = "shm"
    """"shm" (same-host shared memory, the default: needs no system library) or "mooncake" (Transfer
    Engine: across hosts; needs a Mooncake wheel and the system library libibverbs1, even over TCP)."""
    hostname: str = "127.0.0.1"
    """Mooncake: the address peers use to reach this process (its ports still listen on all interfaces)."""
    protocol: str = "tcp"
    """Mooncake: "tcp" or "rdma"."""
    metadata_server: str = "P2PHANDSHAKE"
    """Mooncake: "P2PHANDSHAKE" (no server) or a metadata server URL (etcd://host:port, http://host:port/metadata)."""
    device_name: str = ""
    """Mooncake: comma-separated RDMA devices to use; empty = auto-discover."""
    timeout_s: float = 30.0
    """Default deadline for one batch; the call raises or reports TIMEOUT after it, never hangs."""
    progress_timeout_s: int = 5
    """Mooncake TCP: drop a connection that makes no progress for this long (MC_TCP_PROGRESS_TIMEOUT_SEC)."""
    probe_timeout_s: float = 1.0
    """How long to wait when checking whether a failed peer still accepts connections."""
    log_level: int = 2
    """Mooncake's glog threshold (GLOG_minloglevel) when not set in the environment: 0 info .. 2 error."""
    copy_threads: int = field(default_factory=lambda: max(1, min(8, os.cpu_count() or 1)))
    """Shared memory: threads copying one batch (the calling thread and copy_threads - 1 helpers). A batch
    of 64 MiB or more is cut into pieces of 16 MiB that are copied at once (memmove releases the GIL; one
    thread copies about 5-8 GB/s); smaller batches stay on the calling thread. 1: every batch on the
    calling thread."""
