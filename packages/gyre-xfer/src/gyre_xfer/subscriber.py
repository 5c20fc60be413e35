"""Pull weight snapshots: lease the newest version, check its manifest, read it in buckets of batched
transfers into registered buffers, then release; the result is one whole version or an error.

Tearing is impossible by construction: the publisher never rewrites a leased slot, and a release that
finds the slot rewritten (lease expired) raises SnapshotOverwrittenError; checksums are verified last.
Each tensor's crc32 is computed in pieces of `hash_piece_bytes` on helper threads as soon as a bucket
lands (while the next bucket is read), and the pieces' crcs are combined (`gyre_xfer.crc`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import zmq
from gyre_base.sockets import connected, tcp_port_refuses
from gyre_base.token import TOKEN_ENV

from .buffers import BufferView, numpy_view, torch_view, view_of
from .crc import HASH_PIECE_BYTES, combine_futures, submit_pieces
from .errors import (
    ChecksumError,
    ManifestError,
    PeerGoneError,
    PeerTimeoutError,
    ProtocolError,
    SnapshotOverwrittenError,
    XferError,
)
from .manifest import match_destinations, validate
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
    reply_decoder,
)
from .transport import Op, Region, Transport

_log = logging.getLogger(__name__)

_TOKEN_HINT = f"a publisher with a token answers only subscribers with the same one (${TOKEN_ENV})"

Converter = Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]]
"""A layout hook: takes the pulled tensors by name, returns the tensors the consumer wants (e.g. split a
Megatron fused QKV into transformers' q/k/v projections; see gyre_xfer.convert)."""


@dataclass(frozen=True)
class SubscriberConfig:
    publisher: str
    """The publisher's control address (`Publisher.address`), e.g. tcp://127.0.0.1:5555."""
    control_timeout_s: float = 10.0
    """Deadline for one control request (lease, release)."""
    pull_timeout_s: float = 600.0
    """Deadline for the bytes of one whole version."""
    bucket_bytes: int = 256 << 20
    """Bytes per batched read; large tensors are cut into pieces of at most this size."""
    verify_checksums: bool = True
    """Recompute each tensor's crc32 after the pull and compare with the manifest."""
    hash_threads: int = field(default_factory=lambda: max(1, min(8, os.cpu_count() or 1)))
    """Threads computing crc32s, one piece each at a time (zlib releases the GIL, so they run in
    parallel: one core hashes about 2 GB/s, which alone made a 1.2 GB push take 0.6 s on the H200)."""
    hash_piece_bytes: int = HASH_PIECE_BYTES
    """Tensors are hashed in pieces of at most this many bytes, the pieces' crcs then combined, so one
    large tensor (an embedding) is hashed on several threads rather than one."""
    max_bytes: int = 1 << 40
    """A manifest whose tensors reach further into the slot than this is refused (ManifestError) before
    anything is allocated: a publisher's word never makes a subscriber map unbounded memory."""
    token: str = field(default="", repr=False)
    """The run token, when the publisher has one; empty: $GYRE_TOKEN, or none."""
    pinning: Pinning | None = field(default=None, compare=False)
    """Page-locks the staging buffer (pulls without `into`) once per buffer, when the pulled tensors go
    on to a GPU (`gyre_xfer.pinning.host_pinning(device)`); None: the staging stays pageable. A refusal
    is logged as a warning and the staging stays pageable."""


@dataclass(frozen=True)
class Snapshot:
    """One whole version. `arrays` are numpy views (bfloat16 as uint16 words) into the subscriber's
    staging buffer, valid until the next `pull` without `into`."""

    version: int
    manifest: Manifest
    arrays: Mapping[str, np.ndarray]
    elapsed_s: float = 0.0
    nbytes: int = 0
    pinned: bool = False
    """The arrays lie in page-locked memory: copies from them to a GPU may be asynchronous (synchronize
    before the next pull reuses the staging)."""

    def torch(self) -> dict[str, Any]:
        """The same bytes as torch CPU tensors with their true dtypes (needs the torch extra)."""
        by_name = {t.name: t for t in self.manifest.tensors}
        out = {}
        for name, arr in self.arrays.items():
            t = by_name.get(name)
            out[name] = torch_view(arr.reshape(-1).view(np.uint8), t.dtype, t.shape) if t else arr
        return out


@dataclass
class _Stats:
    pulls: int = 0
    restarts_seen: int = 0
    incarnation: str = ""
    registered: dict[tuple[int, int], Region] = field(default_factory=dict)


class Subscriber:
    """Pulls versions from one publisher into this process's registered memory."""

    def __init__(self, transport: Transport, config: SubscriberConfig) -> None:
        self.transport = transport
        self.config = config
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock = connected(self._ctx, zmq.DEALER, config.publisher, config.token)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = reply_decoder()
        self._rids = itertools.count(1)
        self._staging: Region | None = None
        self._staging_pinned_by: Pinning | None = None  # who pinned the staging: it unpins it too
        self._hasher = ThreadPoolExecutor(max_workers=config.hash_threads, thread_name_prefix="gyre-xfer-crc")
        self.stats = _Stats()

    # ---- control ----------------------------------------------------------------------------------

    def _request(self, req: Request) -> Reply:
        """Send `req` and return its reply; one deadline (`control_timeout_s`) covers the whole wait, so a
        peer that keeps sending frames that are not the reply cannot stretch it."""
        rid = str(next(self._rids)).encode()
        try:
            self._sock.send_multipart([rid, self._encoder.encode(req)], flags=zmq.NOBLOCK)
        except zmq.Again:
            raise PeerTimeoutError(
                f"publisher {self.config.publisher} is not taking requests (send queue full, or no "
                f"connection: {_TOKEN_HINT})"
            ) from None
        deadline = time.monotonic() + self.config.control_timeout_s
        while (left := deadline - time.monotonic()) > 0 and self._sock.poll(int(left * 1000) + 1, zmq.POLLIN):
            frames = self._sock.recv_multipart()
            if len(frames) == 2 and frames[0] == rid:
                try:
                    return self._decoder.decode(frames[1])
                except msgspec.DecodeError as e:
                    raise ProtocolError(f"undecodable reply from {self.config.publisher}: {e}") from e
            # a late reply to an earlier request that timed out, or not a reply at all: drop it
        if tcp_port_refuses(self.config.publisher):
            raise PeerGoneError(f"publisher {self.config.publisher} is gone (connection refused)")
        raise PeerTimeoutError(
            f"publisher {self.config.publisher} did not answer {type(req).__name__} "
            f"within {self.config.control_timeout_s} s ({_TOKEN_HINT})"
        )

    def hello(self) -> Welcome:
        """Check the publisher speaks our protocol and uses our transport."""
        reply = self._request(Hello(PROTOCOL_VERSION, self.transport.endpoint))
        if isinstance(reply, ErrorReply):
            raise ProtocolError(f"publisher refused hello: {reply.message}")
        if not isinstance(reply, Welcome):
            raise ProtocolError(f"expected welcome, got {type(reply).__name__}")
        if reply.transport != self.transport.kind:
            raise ProtocolError(
                f"publisher uses transport {reply.transport.name}, this subscriber {self.transport.kind.name}"
            )
        return reply

    # ---- pulling ----------------------------------------------------------------------------------

    def pull(
        self,
        min_version: int = 0,
        into: Mapping[str, Any] | None = None,
        dtypes: Mapping[str, str] | None = None,
        convert: Converter | None = None,
    ) -> Snapshot:
        """Pull the newest version >= `min_version`. With `into` (name -> numpy array or torch tensor,
        registered on first use) the bytes land there directly, and on error those buffers hold a mix:
        re-pull before using them. Without `into` they land in a staging buffer owned by the subscriber."""
        t0 = time.monotonic()
        reply = self._request(Acquire(min_version))
        if isinstance(reply, ErrorReply):
            if reply.code == ErrorCode.NO_VERSION:
                raise XferError(f"no version >= {min_version} yet: {reply.message}")
            raise ProtocolError(f"publisher refused the lease: {reply.message}")
        if not isinstance(reply, Lease):
            raise ProtocolError(f"expected a lease, got {type(reply).__name__}")
        released = False
        try:
            m = reply.manifest
            validate(m)
            _check_extent(m, self.config.max_bytes)
            if m.transport != self.transport.kind:
                raise ManifestError(
                    f"manifest is for transport {m.transport.name}, not {self.transport.kind.name}"
                )
            self._note_incarnation(m)
            targets = self._targets(m, into, dtypes)
            sums = self._read_all(m, targets, t0)
            released = True
            rel = self._request(Release(reply.lease_id))
            if isinstance(rel, ErrorReply) or not isinstance(rel, Released) or not rel.intact:
                why = rel.message if isinstance(rel, ErrorReply) else "its slot was rewritten"
                raise SnapshotOverwrittenError(
                    f"version {m.version} changed under the pull ({why}); lease was {reply.lease_s} s"
                )
            arrays = {
                t.name: numpy_view(targets[t.name][0], t.dtype, t.shape)
                for t in m.tensors
                if targets[t.name][0].nbytes == t.nbytes  # device destinations have no CPU view
            }
            _verify(m, sums)
        except BaseException:
            if not released:
                with contextlib.suppress(XferError):
                    self._request(Release(reply.lease_id))
            raise
        self.stats.pulls += 1
        nbytes = sum(t.nbytes for t in m.tensors)
        pinned = into is None and self.staging_pinned
        snap = Snapshot(m.version, m, arrays, time.monotonic() - t0, nbytes, pinned)
        if convert is not None:  # converted arrays may be fresh (pageable) copies
            snap = Snapshot(snap.version, m, dict(convert(arrays)), snap.elapsed_s, nbytes)
        return snap

    def _note_incarnation(self, m: Manifest) -> None:
        if self.stats.incarnation and self.stats.incarnation != m.incarnation:
            self.stats.restarts_seen += 1  # new process, new regions: nothing cached about the old one
        self.stats.incarnation = m.incarnation
        self.transport.note_peer(m.endpoint, m.incarnation)

    def _targets(
        self, m: Manifest, into: Mapping[str, Any] | None, dtypes: Mapping[str, str] | None
    ) -> dict[str, tuple[np.ndarray, Region, int]]:
        """name -> (uint8 view of its destination, registered region holding it, offset in region)."""
        out: dict[str, tuple[np.ndarray, Region, int]] = {}
        if into is None:
            need = _extent(m)
            if self._staging is None or self._staging.nbytes < need:
                self._release_staging()
                self._staging = self.transport.alloc(need)
                self._pin_staging(self._staging)
            arr = self._staging.array
            assert arr is not None
            for t in m.tensors:
                out[t.name] = (arr[t.offset : t.offset + t.nbytes], self._staging, t.offset)
            return out
        dtypes = dtypes or {}
        views: dict[str, BufferView] = {n: view_of(b, dtypes.get(n)) for n, b in into.items()}
        match_destinations(m.tensors, views)
        for name, v in views.items():
            region = self._register(v)
            raw = (
                region.array
                if region.array is not None
                else np.empty(0, np.uint8)  # device memory: no CPU view, checksums skipped
            )
            out[name] = (raw, region, 0)
        return out

    def _pin_staging(self, region: Region) -> None:
        self._staging_pinned_by = pin_or_keep_pageable(self.config.pinning, region, "staging buffer", _log)

    def _release_staging(self) -> None:
        """Unpin (if pinned) and unregister the staging buffer."""
        staging, self._staging = self._staging, None
        pinned_by, self._staging_pinned_by = self._staging_pinned_by, None
        if staging is not None:
            unpin_and_unregister(self.transport, staging, pinned_by, "staging buffer", _log)

    @property
    def staging_pinned(self) -> bool:
        """Whether the current staging buffer is page-locked."""
        return self._staging_pinned_by is not None

    def _register(self, v: BufferView) -> Region:
        key = (v.addr, v.nbytes)
        region = self.stats.registered.get(key)
        if region is None:
            region = self.transport.register(v.owner)
            self.stats.registered[key] = region
        return region

    def _read_all(
        self, m: Manifest, targets: dict[str, tuple[np.ndarray, Region, int]], t0: float
    ) -> dict[str, list[tuple[Future[int], int]]]:
        """Read every bucket; as soon as one has landed its bytes are hashed in pieces of at most
        `hash_piece_bytes` on helper threads, overlapping the next bucket's transfer. Returns name ->
        (crc32 future, length) of each of its pieces, in order."""
        deadline = t0 + self.config.pull_timeout_s
        sums: dict[str, list[tuple[Future[int], int]]] = {}
        by_name = {t.name: t for t in m.tensors}
        for bucket, owners in _buckets(m.tensors, targets, m, self.config.bucket_bytes):
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerTimeoutError(
                    f"pulling version {m.version} took over {self.config.pull_timeout_s} s"
                )
            result = self.transport.read(m.endpoint, bucket, timeout_s=left)
            result.raise_for_status(m.endpoint, f"pulling version {m.version}")
            if self.config.verify_checksums:
                for op, (name, pos) in zip(bucket, owners, strict=True):
                    raw = targets[name][0]
                    if by_name[name].crc32 >= 0 and raw.nbytes == by_name[name].nbytes:
                        piece = raw[pos : pos + op.length]
                        pieces = submit_pieces(self._hasher, piece, self.config.hash_piece_bytes)
                        sums.setdefault(name, []).extend(pieces)
        return sums

    def close(self) -> None:
        self._hasher.shutdown(wait=True)
        self._sock.close()
        self._ctx.term()
        for region in self.stats.registered.values():
            self.transport.unregister(region)
        self.stats.registered.clear()
        self._release_staging()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _buckets(
    tensors: tuple[TensorEntry, ...],
    targets: dict[str, tuple[np.ndarray, Region, int]],
    m: Manifest,
    bucket_bytes: int,
) -> Iterator[tuple[list[Op], list[tuple[str, int]]]]:
    """Cut tensors into pieces of at most `bucket_bytes` and group them into batches of about that size;
    each batch comes with (tensor name, offset in the tensor) of each of its ops."""
    bucket: list[Op] = []
    owners: list[tuple[str, int]] = []
    size = 0
    for t in tensors:
        _, region, base = targets[t.name]
        pos = 0
        while pos < t.nbytes or (t.nbytes == 0 and pos == 0):
            n = min(bucket_bytes, t.nbytes - pos)
            bucket.append(Op(region, base + pos, m.region, t.offset + pos, n))
            owners.append((t.name, pos))
            size += n
            pos += max(n, 1)
            if size >= bucket_bytes:
                yield bucket, owners
                bucket, owners, size = [], [], 0
    if bucket:
        yield bucket, owners


def _extent(m: Manifest) -> int:
    """Bytes of the slot the tensors reach (the staging a pull without `into` needs)."""
    return max((t.offset + t.nbytes for t in m.tensors), default=0)


def _check_extent(m: Manifest, max_bytes: int) -> None:
    if _extent(m) > max_bytes:
        raise ManifestError(
            f"version {m.version} reaches {_extent(m)} bytes into its slot, over this subscriber's "
            f"max_bytes ({max_bytes})"
        )


def _verify(m: Manifest, sums: Mapping[str, list[tuple[Future[int], int]]]) -> None:
    """Compare the crc32s computed during the pull (per piece, combined here) with the manifest's
    (device memory is not checked)."""
    for t in m.tensors:
        pieces = sums.get(t.name)
        if pieces is None:
            continue
        got = combine_futures(pieces)
        if got != t.crc32:
            raise ChecksumError(f"{t.name!r} of version {m.version}: crc32 {got:#x} != {t.crc32:#x}")
