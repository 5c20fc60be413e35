"""Host memory of the prefix cache's host tier: one buffer, allocated once at the tier's size (page-locked
when the engine runs on a GPU), from which each spilled entry takes its span.

An entry's KV is every layer's keys and values, each a plane (`[1, kv_heads, length, head_dim]`); its
span is one contiguous range of the buffer per plane, each taken first fit, so an entry fills the holes
that smaller ones left (a plane is 1/56 of an entry of the Qwen3-0.6B shape). Why one buffer rather than a host tensor per layer and
entry: an engine spills and drops contexts for hours, and a host tensor per layer's K and V (tens of MiB
each) left the process holding 2.4x the tier's size after a few hundred spills, the C library's heap
keeping what the tensors freed (`bench/host_tier_rss.py`); and page-locked copies run at about 55 GB/s
each way on the H200, against 7.5 GB/s to the device and 14.6 from it for pageable memory.

A span is held by its entry, and read through leases: a lookup that serves an entry hands out views of
it (`HostRowKV`) that hold a lease, and the span is not given to another entry while any lease lives,
even after its own entry has left the cache (a call copies a hit to the device after the same step
spilled another context; an offer copies it on another thread). Leases go when the last `HostRowKV`
holding them does; the views alone do not hold the span: whoever reads them keeps the `HostRowKV`.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import dataclass, replace

import numpy as np
import torch
from gyre_xfer.pinning import Pinning, PinningError
from gyre_xfer.protocol import RegionDesc
from gyre_xfer.transport import Region

from gyre_engine.server.batch import RowKV

log = logging.getLogger(__name__)

PAGE = 1 << 12
ALIGN = 8
"""Ranges start at multiples of this many bytes (every KV dtype's item size divides it; a plane of the
Qwen3-0.6B shape is a multiple of 2 KiB)."""


@dataclass(eq=False)
class Span:
    """An entry's ranges of the arena (start, end), one per plane: held by the entry until `release`,
    read while `readers`."""

    ranges: list[tuple[int, int]]
    held: bool = True
    readers: int = 0


@dataclass(eq=False)
class HostRowKV(RowKV):
    """KV in the arena: views of `span`. An entry's own has no lease; a lookup's holds one (`lease`), and
    so does every crop of it."""

    span: Span | None = None
    lease: object | None = None

    def crop(self, n: int) -> HostRowKV:
        return HostRowKV(
            [k[:, :, :n] for k in self.keys], [v[:, :, :n] for v in self.values], self.span, self.lease
        )


class _Lease:
    """What a lookup's `HostRowKV` holds: the span is read while it lives."""

    __slots__ = ("__weakref__",)


class HostArena:
    """One host buffer of `nbytes`, allocated at the first `place` (or `reserve`); spans are taken first
    fit from its free ranges and given back when neither their entry nor a lease holds them.

    `pinning`: page-locks the buffer once (None: stays pageable, as on the CPU; a pinning that refuses is
    logged and the buffer stays pageable). Thread-safe: leases end on whatever thread drops them."""

    def __init__(self, nbytes: int, pinning: Pinning | None = None) -> None:
        if nbytes <= 0:
            raise ValueError(f"a host arena needs a positive size, not {nbytes} bytes")
        self.nbytes = nbytes
        self._pinning = pinning
        self._buf: np.ndarray | None = None
        self._free: list[tuple[int, int]] = [(0, nbytes)]
        """Free ranges (start, end), sorted and coalesced."""
        self._lock = threading.Lock()
        self.pinned = False

    @property
    def allocated(self) -> bool:
        return self._buf is not None

    def reserve(self) -> None:
        """Allocate (and page-lock) the buffer now, if not done yet: seconds for gigabytes, better spent
        at start-up than in the first spill. Every page is made resident here (page-locking does it, or
        a write to each page), so the process holds the whole tier from the start and no copy into it
        faults pages in."""
        if self._buf is not None:
            return
        t0 = time.perf_counter()
        raw = np.empty(self.nbytes + PAGE, np.uint8)
        start = -raw.ctypes.data % PAGE
        buf = raw[start : start + self.nbytes]  # page-aligned, as CUDA's registration of host memory wants
        if self._pinning is not None:
            region = Region(RegionDesc(0, self.nbytes, buf.ctypes.data), "cpu", buf, buf)
            try:
                self._pinning.pin(region)
            except PinningError as exc:
                log.warning("host tier: %d MiB stay pageable (copies are slower): %s", self.nbytes >> 20, exc)
            else:
                self.pinned = True
                finalizer = weakref.finalize(self, self._pinning.unpin, region)
                finalizer.atexit = False  # at exit the memory goes with the process
        if not self.pinned:
            buf[::PAGE] = 0  # one write in each page
        self._buf = buf
        log.info(
            "host tier: %d MiB of %s host memory allocated in %.2f s",
            self.nbytes >> 20,
            "page-locked" if self.pinned else "pageable",
            time.perf_counter() - t0,
        )

    def free_bytes(self) -> int:
        with self._lock:
            return sum(end - start for start, end in self._free)

    def free_ranges(self) -> list[tuple[int, int]]:
        """The free ranges (start, end), in order."""
        with self._lock:
            return list(self._free)

    def place(self, kv: RowKV) -> HostRowKV | None:
        """A copy of `kv` in a span of the arena (its entry's: no lease), or None when no free range is
        large enough."""
        planes = (*kv.keys, *kv.values)
        self.reserve()
        buf = self._buf
        assert buf is not None
        ranges: list[tuple[int, int]] = []
        with self._lock:
            for t in planes:
                got = self._take(-(-t.numel() * t.element_size() // ALIGN) * ALIGN)
                if got is None:
                    for r in ranges:
                        self._give_back(r)
                    return None
                ranges.append(got)
        views = []
        for t, (start, end) in zip(planes, ranges, strict=True):
            v = torch.from_numpy(buf[start:end]).view(t.dtype)[: t.numel()].view(t.shape)
            v.copy_(t)
            views.append(v)
        layers = len(kv.keys)
        return HostRowKV(views[:layers], views[layers:], Span(ranges))

    def lease(self, kv: HostRowKV, n: int) -> HostRowKV:
        """The first `n` tokens of an entry's `kv`, holding a lease on its span until dropped."""
        span = kv.span
        assert span is not None
        lease = _Lease()
        with self._lock:
            span.readers += 1
        weakref.finalize(lease, self._end_lease, span)
        return replace(kv, lease=lease).crop(n)

    def release(self, kv: HostRowKV) -> None:
        """`kv`'s entry no longer holds its span: free unless a lease still reads it."""
        span = kv.span
        assert span is not None
        with self._lock:
            span.held = False
            if not span.readers:
                self._give_back_span(span)

    @staticmethod
    def read(kv: HostRowKV) -> bool:
        """Whether a lease reads `kv`'s span now."""
        return kv.span is not None and kv.span.readers > 0

    def _end_lease(self, span: Span) -> None:
        with self._lock:
            span.readers -= 1
            if not span.readers and not span.held:
                self._give_back_span(span)

    def _take(self, need: int) -> tuple[int, int] | None:
        """The first free range of at least `need` bytes, cut to `need` (the lock is held)."""
        free = self._free
        at = next((i for i, (s, e) in enumerate(free) if e - s >= need), None)
        if at is None:
            return None
        start, end = free[at]
        if end - start == need:
            del free[at]
        else:
            free[at] = (start + need, end)
        return start, start + need

    def _give_back_span(self, span: Span) -> None:
        for r in span.ranges:
            self._give_back(r)
        span.ranges = []

    def _give_back(self, r: tuple[int, int]) -> None:
        """A range to the free list, merged with its neighbours (the lock is held)."""
        start, end = r
        free = self._free
        i = 0
        while i < len(free) and free[i][0] < start:
            i += 1
        if i and free[i - 1][1] == start:
            i -= 1
            start = free.pop(i)[0]
        if i < len(free) and free[i][0] == end:
            end = free.pop(i)[1]
        free.insert(i, (start, end))
