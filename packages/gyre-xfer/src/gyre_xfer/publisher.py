"""Publish versioned weight snapshots: `publish(tensors)` copies them into a registered slot nobody is
reading, computes checksums, and makes that version the newest; a control thread answers subscribers.

A slot is never rewritten while a lease on it is live (leases end on release or after `lease_s`), and
every rewrite bumps the slot's generation, so a subscriber learns at release whether its bytes survived.
If the serving thread dies, the publisher is not left deaf: the error is logged with its traceback and
every later `publish` raises `PublisherDeadError` naming it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import zmq
from gyre_base import sockets

from .buffers import BufferView, view_of
from .crc import HASH_PIECE_BYTES, combine_futures, split
from .errors import PublisherDeadError, XferError
from .manifest import layout
from .pinning import Pinning, pin_or_keep_pageable, unpin_and_unregister
from .protocol import (
    PROTOCOL_VERSION,
    Acquire,
    ErrorCode,
    ErrorReply,
    Hello,
    Lease,
    Manifest,
    Release,
    Released,
    Reply,
    Request,
    TensorEntry,
    Welcome,
    request_decoder,
)
from .transport import Region, Transport

_log = logging.getLogger(__name__)


class PublishBusyError(XferError):
    """Every slot stayed leased for `publish_wait_s`; the new version was not published."""


@dataclass(frozen=True)
class PublisherConfig:
    control: str = "tcp://127.0.0.1:0"
    """ZeroMQ address the control socket binds (port 0 picks a free port; see `Publisher.address`).
    Beyond loopback it needs a token."""
    slots: int = 2
    """Snapshot buffers; the newest version's slot is never rewritten, so 2 lets one write proceed."""
    lease_s: float = 120.0
    """How long a subscriber's lease protects its version; a pull must finish within it."""
    publish_wait_s: float = 180.0
    """How long `publish` waits for a leased slot to free up before raising PublishBusyError."""
    checksums: bool = True
    """Compute a crc32 of each tensor (about 2 GB/s on one core) so subscribers can verify."""
    hash_threads: int = field(default_factory=lambda: max(1, min(8, os.cpu_count() or 1)))
    """Threads computing crc32s, one piece of at most 16 MiB each at a time (zlib releases the GIL, so
    they run in parallel: one core hashes about 2 GB/s, which alone made a 1.2 GB push take 0.6 s on the
    H200); a large tensor's pieces are hashed at once and their crcs combined (`gyre_xfer.crc`)."""
    align: int = 256
    """Byte alignment of each tensor inside a slot."""
    token: str = field(default="", repr=False)
    """The run token (CURVE; subscribers need the same); empty: $GYRE_TOKEN, or none (loopback only)."""
    pinning: Pinning | None = field(default=None, compare=False)
    """Page-locks each slot once, when it is allocated, for publishers fed from a GPU
    (`gyre_xfer.pinning.host_pinning(device)`): device-to-slot copies then run asynchronously, each
    tensor's checksum waiting only for its own copy. None: pageable slots, copies one at a time. A
    refusal is logged as a warning and that slot stays pageable."""


@dataclass
class _Slot:
    region: Region | None = None
    manifest: Manifest | None = None
    generation: int = 0
    writing: bool = False
    leases: dict[int, float] = field(default_factory=dict)  # lease id -> expiry (monotonic)
    pinned_by: Pinning | None = None  # who page-locked the region: it unpins it too


class Publisher:
    """Serves snapshots of named tensors from registered slots over `transport`."""

    def __init__(self, transport: Transport, config: PublisherConfig | None = None) -> None:
        self.transport = transport
        self.config = config or PublisherConfig()
        if self.config.slots < 2:
            raise ValueError("a publisher needs at least 2 slots (one being read, one being written)")
        self.incarnation = transport.incarnation
        self._slots = [_Slot() for _ in range(self.config.slots)]
        self._latest: int | None = None  # slot index of the newest version
        self._version = 0
        self._lease_ids = itertools.count(1)
        self._lease_gen: dict[int, tuple[int, int, bytes]] = {}  # lease id -> (slot, generation, holder)
        self._cond = threading.Condition()
        self._hasher = ThreadPoolExecutor(
            max_workers=self.config.hash_threads, thread_name_prefix="gyre-xfer-crc"
        )
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock = sockets.make_socket(self._ctx, zmq.ROUTER)
        try:
            self.address: str = sockets.bind(
                self._sock, self.config.control, self.config.token, "PublisherConfig.token"
            )
        except BaseException:
            self._sock.close(0)
            self._ctx.term()
            self._hasher.shutdown()
            raise
        self._stop = threading.Event()
        self.failure: BaseException | None = None
        """Why the serving thread died (None while it serves)."""
        self._thread = threading.Thread(target=self._guarded, name="gyre-xfer-publisher", daemon=True)
        self._thread.start()

    @property
    def version(self) -> int:
        return self._version

    # ---- writing a version ------------------------------------------------------------------------

    def publish(self, tensors: Mapping[str, Any], dtypes: Mapping[str, str] | None = None) -> int:
        """Copy `tensors` (numpy arrays or torch tensors, CPU or CUDA) into a free slot; returns the new
        version. `dtypes` overrides dtype names (e.g. {"w": "bfloat16"} for a uint16 numpy array)."""
        if self.failure is not None:
            raise PublisherDeadError(f"the publisher's serving thread died: {self.failure!r}")
        dtypes = dtypes or {}
        views = {name: view_of(t, dtypes.get(name)) for name, t in tensors.items()}
        placements, total = layout(views, self.config.align)
        idx = self._claim_slot()
        slot = self._slots[idx]
        pending: list[Callable[[], None] | None] = []
        try:
            if slot.region is None or slot.region.nbytes < total:
                self._release_slot(slot)
                slot.region = self.transport.alloc(max(total, 1))
                self._pin_slot(slot)
            arr = slot.region.array
            assert arr is not None, "publisher slots live in CPU memory"
            sums: list[list[tuple[Future[int], int]] | None] = []
            for p in placements:  # checksum tensor i on helper threads while tensor i+1 is copied
                dst = arr[p.offset : p.offset + p.nbytes]
                landed = _copy_into(dst, views[p.name], asynchronous=slot.pinned_by is not None)
                pending.append(landed)
                sums.append(
                    [
                        (self._hasher.submit(_crc32_after, landed, dst[a:b]), b - a)
                        for a, b in split(p.nbytes, HASH_PIECE_BYTES)
                    ]
                    if self.config.checksums
                    else None
                )
            entries = [
                TensorEntry(
                    p.name, p.dtype, p.shape, p.offset, p.nbytes, -1 if f is None else combine_futures(f)
                )
                for p, f in zip(placements, sums, strict=True)
            ]
            _wait_all(pending)  # every byte is in the slot before the version is served
        except BaseException:
            with contextlib.suppress(Exception):
                _wait_all(pending)  # no copy still lands in the slot once it is free again
            with self._cond:
                slot.manifest = None
                slot.generation += 1
                slot.writing = False
                self._cond.notify_all()
            raise
        with self._cond:
            self._version += 1
            slot.manifest = Manifest(
                self._version,
                self.incarnation,
                self.transport.kind,
                self.transport.endpoint,
                slot.region.desc,
                tuple(entries),
            )
            slot.generation += 1
            slot.writing = False
            self._latest = idx
            self._cond.notify_all()
            return self._version

    def _pin_slot(self, slot: _Slot) -> None:
        if slot.region is not None:
            slot.pinned_by = pin_or_keep_pageable(self.config.pinning, slot.region, "publisher slot", _log)

    def _release_slot(self, slot: _Slot) -> None:
        """Unpin (if pinned) and unregister a slot's region."""
        region, slot.region = slot.region, None
        pinned_by, slot.pinned_by = slot.pinned_by, None
        if region is not None:
            unpin_and_unregister(self.transport, region, pinned_by, "publisher slot", _log)

    def _claim_slot(self) -> int:
        """Pick a slot with no live lease that is not the newest; mark it as being written."""
        deadline = time.monotonic() + self.config.publish_wait_s
        with self._cond:
            while True:
                now = time.monotonic()
                for i, s in enumerate(self._slots):
                    s.leases = {k: v for k, v in s.leases.items() if v > now}
                    if i != self._latest and not s.leases and not s.writing:
                        s.writing = True
                        s.manifest = None  # no longer served
                        s.generation += 1  # any lease still held on it now fails at release
                        return i
                if now >= deadline:
                    raise PublishBusyError(
                        f"all {len(self._slots)} slots stayed leased for {self.config.publish_wait_s} s"
                    )
                self._cond.wait(min(0.05, deadline - now))

    # ---- serving ----------------------------------------------------------------------------------

    def _answer(self, req: Request, peer: bytes) -> Reply:
        """The reply to `req` from the connection `peer` (its ROUTER identity): a lease can be released
        only by the connection that acquired it."""
        if isinstance(req, Hello):
            if req.protocol != PROTOCOL_VERSION:
                return ErrorReply(
                    ErrorCode.PROTOCOL_MISMATCH,
                    f"publisher speaks protocol {PROTOCOL_VERSION}, client {req.protocol}",
                )
            return Welcome(
                PROTOCOL_VERSION,
                self.incarnation,
                self.transport.kind,
                self.transport.endpoint,
                self._version,
            )
        if isinstance(req, Acquire):
            with self._cond:
                if self._latest is None or self._version < req.min_version:
                    return ErrorReply(
                        ErrorCode.NO_VERSION,
                        f"newest version is {self._version}, asked for >= {req.min_version}",
                    )
                slot = self._slots[self._latest]
                assert slot.manifest is not None
                lease_id = next(self._lease_ids)
                slot.leases[lease_id] = time.monotonic() + self.config.lease_s
                self._lease_gen[lease_id] = (self._latest, slot.generation, peer)
                if len(self._lease_gen) > 4096:  # forget the oldest unreleased leases
                    for k in list(self._lease_gen)[:1024]:
                        del self._lease_gen[k]
                return Lease(lease_id, self.config.lease_s, slot.manifest)
        if isinstance(req, Release):
            with self._cond:
                held = self._lease_gen.get(req.lease_id)
                if held is None or held[2] != peer:
                    return ErrorReply(
                        ErrorCode.UNKNOWN_LEASE, f"lease {req.lease_id} is not held by this peer"
                    )
                del self._lease_gen[req.lease_id]
                idx, gen, _ = held
                slot = self._slots[idx]
                slot.leases.pop(req.lease_id, None)
                self._cond.notify_all()
                return Released(req.lease_id, slot.generation == gen)
        return ErrorReply(ErrorCode.BAD_REQUEST, f"unexpected request {type(req).__name__}")

    def _guarded(self) -> None:
        try:
            self._serve()
        except BaseException as exc:
            self.failure = exc
            _log.critical("gyre-xfer publisher at %s stopped serving", self.address, exc_info=exc)

    def _serve(self) -> None:
        decoder = request_decoder()
        encoder = msgspec.msgpack.Encoder()
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self._sock.recv_multipart()
            if len(frames) != 3:
                continue  # [identity, request id, payload]; anything else is not ours
            ident, rid, payload = frames
            reply: Reply
            try:
                reply = self._answer(decoder.decode(payload), ident)
            except msgspec.ValidationError as e:
                reply = ErrorReply(ErrorCode.BAD_REQUEST, f"undecodable request: {e}")
            except msgspec.DecodeError as e:
                reply = ErrorReply(ErrorCode.BAD_REQUEST, f"undecodable request: {e}")
            self._sock.send_multipart([ident, rid, encoder.encode(reply)])

    def close(self) -> None:
        """Stop serving, close the socket, and unregister every slot."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()
        self._ctx.term()
        self._hasher.shutdown(wait=True)
        for s in self._slots:
            self._release_slot(s)

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _copy_into(dst: np.ndarray, src: BufferView, asynchronous: bool) -> Callable[[], None] | None:
    """Copy a tensor's bytes into a uint8 slice of the slot (torch handles CUDA sources). With
    `asynchronous` (the slot is page-locked) a device source's copy is only queued on its device's
    current stream: the returned call waits until it has landed. None: the bytes are there already."""
    if isinstance(src.owner, np.ndarray):
        np.copyto(dst, src.owner.reshape(-1).view(np.uint8))
        return None
    import torch

    t = src.owner
    assert isinstance(t, torch.Tensor)
    if not (asynchronous and t.is_cuda):
        torch.from_numpy(dst).copy_(t.reshape(-1).view(torch.uint8))
        return None
    with torch.cuda.device(t.device):
        torch.from_numpy(dst).copy_(t.reshape(-1).view(torch.uint8), non_blocking=True)
        landed = torch.cuda.Event()
        landed.record()
    return landed.synchronize


def _crc32_after(landed: Callable[[], None] | None, dst: np.ndarray) -> int:
    """crc32 of (a piece of) a slot slice once its copy has landed (runs on a hashing thread)."""
    if landed is not None:
        landed()
    return zlib.crc32(dst)


def _wait_all(pending: list[Callable[[], None] | None]) -> None:
    for landed in pending:
        if landed is not None:
            landed()
