"""KV-cache block transfer between two processes' registered pools, with a result per block.

A pool is 2 x num_layers planes (layer-major, K then V), each `num_blocks` blocks of `block_nbytes`;
it is one arena (`KvPool.allocate`) or an engine's own per-layer K and V buffers (`KvPool.from_buffers`).
`pull`/`push` move a list of blocks in one batch (runs of adjacent blocks coalesced) and never raise on
a transfer failure: each block reports OK, OUT_OF_RANGE, PEER_GONE, TIMEOUT or FAILED. `peer_planes`
maps a same-host peer pool's planes for reading in place (shared memory), where a copy would be one too many.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .buffers import view_of
from .errors import ShapeMismatchError
from .protocol import KvPlane, KvPoolDesc
from .transport import EntryStatus, Op, Region, Transport

_SEVERITY = [
    EntryStatus.OK,
    EntryStatus.NOT_ATTEMPTED,
    EntryStatus.FAILED,
    EntryStatus.OUT_OF_RANGE,
    EntryStatus.TIMEOUT,
    EntryStatus.PEER_GONE,
]


@dataclass(frozen=True, slots=True)
class BlockResult:
    src_block: int
    dst_block: int
    status: EntryStatus


@dataclass(frozen=True, slots=True)
class KvTransferResult:
    blocks: tuple[BlockResult, ...]
    elapsed_s: float
    nbytes: int
    detail: str = ""

    @property
    def ok(self) -> bool:
        return all(b.status is EntryStatus.OK for b in self.blocks)

    @property
    def arrived(self) -> list[int]:
        """Destination block ids whose K and V bytes of every layer arrived."""
        return [b.dst_block for b in self.blocks if b.status is EntryStatus.OK]


class KvPool:
    """A registered KV pool of this process; `describe()` is what a peer needs to address it."""

    def __init__(
        self,
        transport: Transport,
        regions: Sequence[Region],
        planes: Sequence[tuple[int, int]],
        num_layers: int,
        num_blocks: int,
        block_nbytes: int,
        incarnation: str = "",
    ) -> None:
        if len(planes) != 2 * num_layers:
            raise ShapeMismatchError(
                f"{num_layers} layers need {2 * num_layers} K/V planes, got {len(planes)}"
            )
        for r, off in planes:
            if off + num_blocks * block_nbytes > regions[r].nbytes:
                raise ShapeMismatchError(
                    f"plane at offset {off} of region {r} is shorter than {num_blocks} blocks"
                )
        self.transport = transport
        self.regions = list(regions)
        self.planes = list(planes)
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_nbytes = block_nbytes
        self.incarnation = incarnation or transport.incarnation

    @classmethod
    def allocate(cls, transport: Transport, num_layers: int, num_blocks: int, block_nbytes: int) -> KvPool:
        """One arena holding every plane back to back."""
        region = transport.alloc(cls.arena_nbytes(num_layers, num_blocks, block_nbytes))
        return cls.in_arena(transport, region, num_layers, num_blocks, block_nbytes)

    @staticmethod
    def arena_nbytes(num_layers: int, num_blocks: int, block_nbytes: int) -> int:
        """Bytes of the one arena `allocate` takes for this shape."""
        return 2 * num_layers * num_blocks * block_nbytes

    @classmethod
    def in_arena(
        cls, transport: Transport, region: Region, num_layers: int, num_blocks: int, block_nbytes: int
    ) -> KvPool:
        """A pool laid out in `region` (from `transport.alloc`, at least `arena_nbytes` long) as
        `allocate` lays one out: how an arena freed by an earlier pool is used again without new memory
        (allocating fresh memory costs the kernel a page fault and a zeroed page per 4 KiB)."""
        plane = num_blocks * block_nbytes
        planes = [(0, p * plane) for p in range(2 * num_layers)]
        return cls(transport, [region], planes, num_layers, num_blocks, block_nbytes)

    @classmethod
    def from_buffers(cls, transport: Transport, k: Sequence[Any], v: Sequence[Any]) -> KvPool:
        """Register an engine's own per-layer K and V buffers (numpy or torch, first dim = block)."""
        if len(k) != len(v) or not k:
            raise ShapeMismatchError(f"need as many K as V buffers (got {len(k)} and {len(v)}), at least one")
        views = [view_of(b) for pair in zip(k, v, strict=True) for b in pair]
        num_blocks = views[0].shape[0] if views[0].shape else 0
        block_nbytes = views[0].nbytes // max(num_blocks, 1)
        for i, vw in enumerate(views):
            if (vw.shape[:1], vw.nbytes) != ((num_blocks,), views[0].nbytes):
                raise ShapeMismatchError(f"KV plane {i} has shape {vw.shape}; plane 0 has {views[0].shape}")
        regions = [transport.register(vw.owner) for vw in views]
        return cls(
            transport, regions, [(i, 0) for i in range(len(regions))], len(k), num_blocks, block_nbytes
        )

    def describe(self) -> KvPoolDesc:
        return KvPoolDesc(
            self.transport.kind,
            self.transport.endpoint,
            self.incarnation,
            tuple(r.desc for r in self.regions),
            tuple(KvPlane(r, off) for r, off in self.planes),
            self.num_layers,
            self.num_blocks,
            self.block_nbytes,
        )

    def block(self, layer: int, kv: int, block_id: int) -> np.ndarray:
        """uint8 view of one block of one plane (CPU pools only)."""
        r, off = self.planes[2 * layer + kv]
        arr = self.regions[r].array
        if arr is None:
            raise ShapeMismatchError("this pool lives in device memory: no CPU view")
        start = off + block_id * self.block_nbytes
        return arr[start : start + self.block_nbytes]

    def pull(
        self,
        src: KvPoolDesc,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        timeout_s: float | None = None,
    ) -> KvTransferResult:
        """Read blocks `src_blocks` of the peer pool `src` into this pool's `dst_blocks`."""
        return self._move(src, list(dst_blocks), list(src_blocks), timeout_s, pull=True)

    def push(
        self,
        dst: KvPoolDesc,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        timeout_s: float | None = None,
    ) -> KvTransferResult:
        """Write this pool's `src_blocks` into the peer pool `dst`'s `dst_blocks`."""
        return self._move(dst, list(src_blocks), list(dst_blocks), timeout_s, pull=False)

    def _move(
        self, peer: KvPoolDesc, local: list[int], remote: list[int], timeout_s: float | None, pull: bool
    ) -> KvTransferResult:
        t0 = time.monotonic()
        if len(local) != len(remote):
            raise ShapeMismatchError(f"{len(local)} local blocks but {len(remote)} peer blocks")
        if (peer.num_layers, peer.block_nbytes) != (self.num_layers, self.block_nbytes):
            raise ShapeMismatchError(
                f"peer pool has {peer.num_layers} layers x {peer.block_nbytes}-byte blocks, "
                f"this pool {self.num_layers} x {self.block_nbytes}"
            )
        self.transport.note_peer(peer.endpoint, peer.incarnation)
        if len(set(local if pull else remote)) != len(local):
            raise ShapeMismatchError("destination block ids repeat")
        status = [EntryStatus.OK] * len(local)
        good = []
        for i, (lb, rb) in enumerate(zip(local, remote, strict=True)):
            if not (0 <= lb < self.num_blocks and 0 <= rb < peer.num_blocks):
                status[i] = EntryStatus.OUT_OF_RANGE
            else:
                good.append(i)
        runs = _runs([(local[i], remote[i], i) for i in good])
        ops: list[Op] = []
        owners: list[list[int]] = []
        bn = self.block_nbytes
        for p in range(2 * self.num_layers):
            lr, loff = self.planes[p]
            rp = peer.planes[p]
            rdesc = peer.regions[rp.region]
            for lb, rb, n, idx in runs:
                ops.append(Op(self.regions[lr], loff + lb * bn, rdesc, rp.offset + rb * bn, n * bn))
                owners.append(idx)
        detail = ""
        if ops:
            res = (self.transport.read if pull else self.transport.write)(peer.endpoint, ops, timeout_s)
            detail = res.detail
            for st, idx in zip(res.statuses, owners, strict=True):
                for i in idx:
                    if _SEVERITY.index(st) > _SEVERITY.index(status[i]):
                        status[i] = st
        src, dst = (remote, local) if pull else (local, remote)
        blocks = tuple(BlockResult(s, d, st) for s, d, st in zip(src, dst, status, strict=True))
        moved = sum(1 for st in status if st is EntryStatus.OK) * 2 * self.num_layers * bn
        return KvTransferResult(blocks, time.monotonic() - t0, moved, detail)

    def close(self) -> None:
        for r in self.regions:
            self.transport.unregister(r)
        self.regions = []


def _runs(pairs: list[tuple[int, int, int]]) -> list[tuple[int, int, int, list[int]]]:
    """Coalesce (local, remote, index) triples, in order, into runs adjacent on both sides."""
    out: list[tuple[int, int, int, list[int]]] = []
    for lb, rb, i in pairs:
        if out:
            l0, r0, n, idx = out[-1]
            if lb == l0 + n and rb == r0 + n:
                idx.append(i)
                out[-1] = (l0, r0, n + 1, idx)
                continue
        out.append((lb, rb, 1, [i]))
    return out


def peer_planes(transport: Transport, src: KvPoolDesc) -> list[np.ndarray] | None:
    """The peer pool `src`'s 2 x num_layers planes (each `num_blocks` blocks) as uint8 views read in
    place, where `transport` maps peer memory (shared memory on this host); else None (then
    `pull` copies). Raises PeerGoneError if the peer's memory is gone, ShapeMismatchError if a plane
    lies outside its region."""
    from .shm import ShmTransport

    tr = transport
    if not isinstance(tr, ShmTransport) or src.transport != tr.kind or src.endpoint != tr.endpoint:
        return None
    if len(src.planes) != 2 * src.num_layers:
        raise ShapeMismatchError(f"peer pool has {len(src.planes)} planes for {src.num_layers} layers")
    size = src.num_blocks * src.block_nbytes
    mapped: dict[int, np.ndarray] = {}
    out = []
    for p in src.planes:
        if not 0 <= p.region < len(src.regions) or p.offset < 0:
            raise ShapeMismatchError(f"peer plane names region {p.region} at offset {p.offset}")
        arr = mapped.get(p.region)
        if arr is None:
            arr = mapped[p.region] = tr.map_peer(src.regions[p.region])
        if p.offset + size > arr.nbytes:
            raise ShapeMismatchError(
                f"peer plane at offset {p.offset} runs past its region of {arr.nbytes} bytes"
            )
        out.append(arr[p.offset : p.offset + size])
    return out
