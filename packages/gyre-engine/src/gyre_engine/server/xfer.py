"""The engine's gyre-xfer side: transports opened on first use, weight snapshots pulled from a gyre-xfer
publisher, and KV prefixes offered from a registered pool or pulled from another engine's.

Bytes move off the engine thread (into gyre-xfer's staging buffer or freshly allocated KV blocks); only
checked, complete results reach the model or the prefix cache, on the engine thread between two steps.
So a torn snapshot, a dead peer or a timeout leaves the model, the version and the cache as they were.

A prefix moves in whole-plane copies: out of the cache's tensors into the offered pool (one copy per layer
and K or V), then into the new KV tensors: over shared memory straight out of the offered pool, mapped
here; otherwise (Mooncake) into a local pool in one batch of runs, and out of it. Pool arenas are
kept for the next hand-off (`XferConfig.kv_spare_bytes`): fresh memory costs the kernel a fault and a
zeroed page per 4 KiB, which cost more than the copies. An offer's arena is reused only after a receipt
that every block arrived (the importer has finished reading it); an expired or failed one is freed.

Between two engines on one GPU ("cuda_ipc"), the prefix never leaves the device: the offer copies it into
one new device buffer on the engine thread (ordered after the KV's own writes) and shares that through
torch's CUDA IPC (`cuda_ipc.py`); the importer, on the same GPU (same UUID), maps it and copies each plane
into a fresh KV tensor, device to device. The buffer ends in the offer id like an arena; releasing the
offer zeroes it first, so an importer of a released offer is refused, not handed other bytes.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field

import msgspec
import numpy as np
import torch
import zmq
from gyre_xfer.convert import megatron_to_hf
from gyre_xfer.errors import PeerGoneError, PeerTimeoutError, XferError
from gyre_xfer.kv import BlockResult, KvPool, KvTransferResult, peer_planes
from gyre_xfer.pinning import Pinning
from gyre_xfer.protocol import KvOffer
from gyre_xfer.shm import ShmTransport
from gyre_xfer.subscriber import Snapshot, Subscriber, SubscriberConfig
from gyre_xfer.transport import Config, EntryStatus, Region, Transport, open_transport

from gyre_engine.protocol import (
    BlockReport,
    CudaIpcTensor,
    OfferPrefixRequest,
    PrefixOffer,
    ProtocolError,
    UpdateFromXferRequest,
)
from gyre_engine.server.batch import RowKV
from gyre_engine.server.cuda_ipc import forgo, open_shared, share, shareable_allocations
from gyre_engine.server.kv_transfer import KvTransferError


@dataclass
class XferConfig:
    """How the engine opens gyre-xfer transports (`gyre-engine serve --xfer-*`)."""

    hostname: str = "127.0.0.1"
    """Mooncake: the address peers use to reach this process (its ports listen on all interfaces: see
    gyre-xfer's README on confining them)."""
    metadata_server: str = "P2PHANDSHAKE"
    """Mooncake: P2P handshake (default) or a metadata server URL."""
    progress_timeout_s: int = 5
    """Mooncake TCP: a connection making no progress for this long fails (a hung peer)."""
    kv_spare_bytes: int = 4 << 30
    """KV pool arenas kept, once free, for later prefix offers and pulls, up to this many bytes (0: none)."""


class KvPullError(RuntimeError):
    """Some blocks of a prefix did not arrive; nothing was installed. `status` is the HTTP status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class NoDeviceRoom(RuntimeError):
    """A device copy of a prefix for a CUDA IPC offer does not fit the GPU's free memory (less what the
    engine keeps free): the offer is made over shared memory instead."""


@dataclass
class _DeviceBuffer:
    """An offer's KV in one buffer on the GPU, shared through CUDA IPC."""

    buffer: torch.Tensor | None
    shared: CudaIpcTensor

    def close(self, read: bool) -> None:
        """Zero the offer id (an importer reading now is refused when it checks it again), give up the
        importer's reference unless it read the buffer and dropped it (`read`: a receipt for every block),
        and drop ours: torch frees the memory once no importer holds it (a share it still counted as held
        waits in torch's list of sent blocks until `ipc_collect`, called here)."""
        buf, self.buffer = self.buffer, None
        if buf is None:
            return
        device = buf.device
        with torch.cuda.device(device):
            buf[-STAMP_BYTES:].zero_()
            torch.cuda.current_stream().synchronize()
        if not read:
            forgo(self.shared)
        del buf
        with torch.cuda.device(device):
            torch.cuda.ipc_collect()


@dataclass
class _Offer:
    pool: KvPool | None
    expires: float
    kind: str
    blocks: int
    device: _DeviceBuffer | None = None

    def close(self) -> None:
        """Freed, never reused (no receipt for every block: the importer may still read it)."""
        if self.pool is not None:
            self.pool.close()
        if self.device is not None:
            self.device.close(read=False)


def _plane(pool: KvPool, plane: int, dtype: torch.dtype, rows: int, heads: int, dim: int) -> torch.Tensor:
    """A torch view `[rows, heads, dim]` of one K or V plane of an allocated (CPU) pool."""
    r, off = pool.planes[plane]
    arr = pool.regions[r].array
    assert arr is not None, "allocated pools live in CPU memory"
    raw = arr[off : off + pool.num_blocks * pool.block_nbytes]
    return torch.from_numpy(raw).view(dtype).view(rows, heads, dim)


STAMP_BYTES = 32
"""An offer's arena ends in its offer id (32 hex digits), written once every byte is in; cleared first
when the arena is reused, so an importer reading a released offer's arena finds out instead of installing
another prefix's KV."""


def _stamp(pool: KvPool) -> np.ndarray:
    arr = pool.regions[0].array
    assert arr is not None, "allocated pools live in CPU memory"
    return arr[pool.regions[0].nbytes - STAMP_BYTES : pool.regions[0].nbytes]


def _check_stamp(stamp: np.ndarray, offer_id: str) -> None:
    if stamp.tobytes() != offer_id.encode():
        raise KvPullError(
            f"offer {offer_id} was released before its blocks were read; nothing was installed", 409
        )


def _out_of_pool(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A plane `[n, heads, dim]` of a pool as KV `[1, heads, n, dim]` on `device`, owning its memory (the
    pool is reused or freed after this)."""
    if device.type == "cpu":  # one transposing copy
        return t.transpose(0, 1).unsqueeze(0).clone(memory_format=torch.contiguous_format)
    t = t.to(device, copy=True)  # one contiguous copy out of the pool ...
    return t.transpose(0, 1).unsqueeze(0).contiguous()  # ... transposed on the device


@dataclass
class XferHub:
    """One per server process: transports, snapshot subscribers and outstanding prefix offers."""

    config: XferConfig = field(default_factory=XferConfig)
    pinning: Pinning | None = None
    """Page-locks each subscriber's staging buffer, for a model on a GPU
    (`gyre_xfer.pinning.host_pinning(engine.device)`: the copies into the model then run at full link
    speed, asynchronously); None (a CPU model): pageable."""
    _transports: dict[str, Transport] = field(default_factory=dict)
    _subscribers: dict[tuple[str, str], Subscriber] = field(default_factory=dict)
    _offers: dict[str, _Offer] = field(default_factory=dict)
    _spares: list[tuple[str, Region]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def transport(self, kind: str) -> Transport:
        with self._lock:
            tr = self._transports.get(kind)
            if tr is None:
                c = self.config
                tr = open_transport(
                    Config(
                        kind=kind,
                        hostname=c.hostname,
                        metadata_server=c.metadata_server,
                        progress_timeout_s=c.progress_timeout_s,
                    )
                )
                self._transports[kind] = tr
            return tr

    # ---- weights ----------------------------------------------------------------------------------

    def pull_snapshot(self, body: UpdateFromXferRequest) -> Snapshot:
        """Pull one whole version into the subscriber's staging buffer (never into the model). Its
        arrays stay valid until the next pull from the same publisher: callers serialize pull + apply,
        and the apply waits for its (asynchronous, when the staging is pinned) copies to land."""
        tr = self.transport(body.transport)
        cfg = SubscriberConfig(
            publisher=body.publisher,
            control_timeout_s=body.control_timeout_s,
            pull_timeout_s=body.timeout_s,
            pinning=self.pinning,
        )
        key = (body.publisher, body.transport)
        with self._lock:
            sub = self._subscribers.get(key)
            if sub is None:
                try:
                    sub = Subscriber(tr, cfg)
                except zmq.ZMQError as exc:  # not an address ZeroMQ can connect to: the body's fault
                    raise ProtocolError(f"publisher {body.publisher[:200]!r}: {exc}") from exc
                self._subscribers[key] = sub
            sub.config = cfg
        try:
            return sub.pull(body.min_version)
        except (PeerGoneError, PeerTimeoutError):
            # a fresh socket next time: a dead publisher's replacement must not see stale requests
            with self._lock:
                self._subscribers.pop(key, None)
            sub.close()
            raise

    # ---- KV prefix: the source side ---------------------------------------------------------------

    def offer(
        self, body: OfferPrefixRequest, token_ids: list[int], kv: RowKV, fingerprint: str, version: str
    ) -> PrefixOffer:
        """Copy `kv` (covering `token_ids`) into a pool of `block_tokens`-token blocks, in a spare arena or
        a new one (freed if the copy fails)."""
        body = _whole_blocks(body, len(token_ids))
        self.sweep()
        n, bt = len(token_ids), body.block_tokens
        nb = -(-n // bt)
        heads, dim = int(kv.keys[0].shape[1]), int(kv.keys[0].shape[3])
        dtype = kv.keys[0].dtype
        # allocated, not registered in place: shared memory can only share memory it allocated itself
        pool = self._pool(body.transport, len(kv.keys), nb, bt * heads * dim * dtype.itemsize)
        offer_id = uuid.uuid4().hex
        try:
            stamp = _stamp(pool)
            stamp[:] = 0  # a reused arena: an importer of its last offer now sees it is gone
            for layer, (k, v) in enumerate(zip(kv.keys, kv.values, strict=True)):
                for plane, t in ((2 * layer, k), (2 * layer + 1, v)):
                    dst = _plane(pool, plane, dtype, nb * bt, heads, dim)
                    dst[:n].copy_(t[0].transpose(0, 1))  # transposed where it lives, one copy into the pool
                    dst[n:] = 0
            stamp[:] = np.frombuffer(offer_id.encode(), np.uint8)
        except BaseException:
            pool.close()
            raise
        kv_offer = KvOffer(offer_id, pool.describe(), tuple(range(nb)), n)
        held = _Offer(pool, time.monotonic() + body.lease_s, body.transport, nb)
        return self._opened(
            offer_id,
            held,
            body,
            token_ids,
            kv,
            fingerprint,
            version,
            msgspec.Raw(msgspec.json.encode(kv_offer)),
        )

    def offer_on_device(
        self,
        body: OfferPrefixRequest,
        token_ids: list[int],
        kv: RowKV,
        fingerprint: str,
        version: str,
        keep_free_bytes: int = 0,
    ) -> PrefixOffer:
        """Copy `kv` (covering `token_ids`, on a GPU) into one new device buffer and share it through CUDA
        IPC. Runs on the engine thread: the copies queue on its stream after the KV's own writes, and the
        buffer's allocation (expandable segments off) is the only one made meanwhile. `NoDeviceRoom` when
        the buffer would leave the GPU less than `keep_free_bytes` free (or does not fit at all)."""
        body = _whole_blocks(body, len(token_ids))
        self.sweep()
        n, layers = len(token_ids), len(kv.keys)
        k0 = kv.keys[0]
        heads, dim, dtype, device = int(k0.shape[1]), int(k0.shape[3]), k0.dtype, k0.device
        if device.type != "cuda" or int(k0.shape[2]) != n:
            raise KvTransferError(
                f"a CUDA IPC offer needs KV of {n} tokens on a GPU, not {list(k0.shape)} on {device}"
            )
        plane = heads * n * dim * dtype.itemsize
        nbytes = buf_nbytes(layers, plane)
        free = int(torch.cuda.mem_get_info(device)[0])
        if free - nbytes < keep_free_bytes:
            raise NoDeviceRoom(
                f"a device copy of the prefix ({nbytes} bytes) would leave {device} {free - nbytes} bytes "
                f"free, under the {keep_free_bytes} the engine keeps"
            )
        offer_id = uuid.uuid4().hex
        with torch.cuda.device(device):
            try:
                with shareable_allocations():
                    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            except torch.OutOfMemoryError as exc:
                raise NoDeviceRoom(
                    f"no room on {device} for a device copy of the prefix ({nbytes} bytes): {exc}"
                ) from exc
            planes = buf[: 2 * layers * plane].view(dtype).view(2 * layers, heads, n, dim)
            for layer, (k, v) in enumerate(zip(kv.keys, kv.values, strict=True)):
                planes[2 * layer].copy_(k[0])
                planes[2 * layer + 1].copy_(v[0])
            del planes
            buf[-STAMP_BYTES:].copy_(torch.frombuffer(bytearray(offer_id.encode()), dtype=torch.uint8))
            shared = share(buf)  # its event follows the copies on this thread's stream
        nb = -(-n // body.block_tokens)
        held = _Offer(None, time.monotonic() + body.lease_s, "cuda_ipc", nb, _DeviceBuffer(buf, shared))
        return self._opened(
            offer_id, held, body, token_ids, kv, fingerprint, version, msgspec.Raw(b"null"), shared
        )

    def _opened(
        self,
        offer_id: str,
        held: _Offer,
        body: OfferPrefixRequest,
        token_ids: list[int],
        kv: RowKV,
        fingerprint: str,
        version: str,
        kv_offer: msgspec.Raw,
        cuda_ipc: CudaIpcTensor | None = None,
    ) -> PrefixOffer:
        """Keep `held` until its receipt or lease, and describe it: the offer the importer pulls."""
        with self._lock:
            self._offers[offer_id] = held
        k0 = kv.keys[0]
        return PrefixOffer(
            offer_id=offer_id,
            model_fingerprint=fingerprint,
            weight_version=version,
            token_ids=list(token_ids),
            dtype=str(k0.dtype).removeprefix("torch."),
            kv_heads=int(k0.shape[1]),
            head_dim=int(k0.shape[3]),
            block_tokens=body.block_tokens,
            lease_s=body.lease_s,
            kv_offer=kv_offer,
            cuda_ipc=cuda_ipc,
        )

    def release(self, offer_id: str, arrived: list[int] | None = None) -> bool:
        """Free an offer's pool; kept for reuse when `arrived` (the receipt) names every block."""
        with self._lock:
            off = self._offers.pop(offer_id, None)
        if off is not None:
            every = arrived is not None and set(arrived) == set(range(off.blocks))
            if off.device is not None:
                off.device.close(read=every)
            elif off.kind == "shm" and every and off.pool is not None:
                self._give_back(off.kind, off.pool)
            else:  # the importer may still be reading it: freed (its mapping keeps the bytes), never reused
                off.close()
        self.sweep()
        return off is not None

    def _pool(self, kind: str, layers: int, blocks: int, block_nbytes: int) -> KvPool:
        """A pool of this shape in the smallest spare arena that holds it, else in a new one."""
        tr = self.transport(kind)
        need = KvPool.arena_nbytes(layers, blocks, block_nbytes) + STAMP_BYTES
        with self._lock:
            fits = [(r.nbytes, i) for i, (k, r) in enumerate(self._spares) if k == kind and r.nbytes >= need]
            region = self._spares.pop(min(fits)[1])[1] if fits else None
        return KvPool.in_arena(tr, region or tr.alloc(need), layers, blocks, block_nbytes)

    def _peer_stamp(self, kind: str, kv_offer: KvOffer) -> np.ndarray:
        tr = self.transport(kind)
        regions = kv_offer.pool.regions
        if not isinstance(tr, ShmTransport) or len(regions) != 1 or regions[0].nbytes < STAMP_BYTES:
            raise KvTransferError("the offered pool is not one arena with an offer stamp")
        return tr.map_peer(regions[0])[-STAMP_BYTES:]

    def _give_back(self, kind: str, pool: KvPool) -> None:
        """Keep `pool`'s arena for a later pool (the newest first, within `kv_spare_bytes`)."""
        if len(pool.regions) != 1:
            pool.close()
            return
        with self._lock:
            self._spares.insert(0, (kind, pool.regions[0]))
            kept, total, drop = [], 0, []
            for k, r in self._spares:
                if total + r.nbytes <= self.config.kv_spare_bytes:
                    kept.append((k, r))
                    total += r.nbytes
                else:
                    drop.append((k, r))
            self._spares = kept
            transports = {k: self._transports.get(k) for k, _ in drop}
        for k, r in drop:
            tr = transports[k]
            if tr is not None:
                tr.unregister(r)

    def sweep(self) -> None:
        """Free offers whose lease ran out without a receipt."""
        now = time.monotonic()
        with self._lock:
            dead = [k for k, o in self._offers.items() if o.expires < now]
            gone = [self._offers.pop(k) for k in dead]
        for o in gone:
            o.close()

    @property
    def open_offers(self) -> int:
        return len(self._offers)

    # ---- KV prefix: the target side ---------------------------------------------------------------

    def pull_prefix(
        self, offer: PrefixOffer, layers: int, device: torch.device, timeout_s: float
    ) -> tuple[RowKV, KvTransferResult]:
        """Pull every block of `offer` into fresh local blocks; raise KvPullError unless all arrived."""
        dtype = getattr(torch, offer.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise KvTransferError(f"unknown KV dtype {offer.dtype!r}")
        if offer.cuda_ipc is not None:
            return self._pull_on_device(offer, offer.cuda_ipc, dtype, layers, device)
        kv_offer = msgspec.json.decode(offer.kv_offer, type=KvOffer)
        n, bt = len(offer.token_ids), offer.block_tokens
        nb = len(kv_offer.block_ids)
        if kv_offer.num_tokens != n or not n or bt < 1 or nb != -(-n // bt):
            raise KvTransferError(f"offer of {nb} blocks x {bt} tokens does not cover {n} token ids")
        if kv_offer.pool.num_layers != layers:
            raise KvTransferError(f"offer has {kv_offer.pool.num_layers} layers, the model {layers}")
        block_nbytes = bt * offer.kv_heads * offer.head_dim * dtype.itemsize
        if kv_offer.pool.block_nbytes != block_nbytes:
            raise KvTransferError(
                f"offer blocks are {kv_offer.pool.block_nbytes} bytes, expected {block_nbytes}"
            )
        kind = kv_offer.pool.transport.name.lower()
        if tuple(kv_offer.block_ids) == tuple(range(nb)) and kv_offer.pool.num_blocks >= nb:
            t0 = time.monotonic()
            try:
                planes = peer_planes(self.transport(kind), kv_offer.pool)
            except PeerGoneError as exc:
                raise KvPullError(
                    f"prefix transfer from {kv_offer.pool.endpoint} failed: {exc}", 502
                ) from exc
            if planes is not None:  # the offered pool is mapped here: copied straight out of it
                stamp = self._peer_stamp(kind, kv_offer)

                def direct(plane: int) -> torch.Tensor:
                    raw = planes[plane][: n * block_nbytes // bt]
                    t = torch.from_numpy(raw).view(dtype).view(n, offer.kv_heads, offer.head_dim)
                    return _out_of_pool(t, device)

                _check_stamp(stamp, offer.offer_id)
                kv = RowKV([direct(2 * i) for i in range(layers)], [direct(2 * i + 1) for i in range(layers)])
                _check_stamp(stamp, offer.offer_id)  # not released and reused while it was read
                blocks = tuple(BlockResult(b, b, EntryStatus.OK) for b in range(nb))
                return kv, KvTransferResult(blocks, time.monotonic() - t0, 2 * layers * nb * block_nbytes)
        pool = self._pool(kind, layers, nb, block_nbytes)
        done = False
        try:
            res = pool.pull(kv_offer.pool, kv_offer.block_ids, list(range(nb)), timeout_s=timeout_s)
            if not res.ok:
                raise _pull_failed(res, kv_offer.pool.endpoint, nb)

            def layer(plane: int) -> torch.Tensor:
                return _out_of_pool(
                    _plane(pool, plane, dtype, nb * bt, offer.kv_heads, offer.head_dim)[:n], device
                )

            kv = RowKV([layer(2 * i) for i in range(layers)], [layer(2 * i + 1) for i in range(layers)])
            done = True
        finally:
            if done:  # every byte copied out: the arena serves the next pull or offer
                self._give_back(kind, pool)
            else:  # a transfer that failed may still be writing into it
                pool.close()
        return kv, res

    def _pull_on_device(
        self, offer: PrefixOffer, shared: CudaIpcTensor, dtype: torch.dtype, layers: int, device: torch.device
    ) -> tuple[RowKV, KvTransferResult]:
        """Map the offer's device buffer (CudaIpcUnreachable unless this engine is on the same GPU), copy
        each plane into a fresh KV tensor, check the offer id before and after, and drop the mapping."""
        n, bt, heads, dim = len(offer.token_ids), offer.block_tokens, offer.kv_heads, offer.head_dim
        if not n or bt < 1 or heads < 1 or dim < 1:
            raise KvTransferError(
                f"offer of {n} token ids in blocks of {bt}, {heads} heads x {dim} does not fit"
            )
        plane = heads * n * dim * dtype.itemsize
        nbytes = buf_nbytes(layers, plane)
        if shared.dtype != "uint8" or shared.size != [nbytes] or shared.stride != [1]:
            raise KvTransferError(
                f"the offered device buffer is {shared.dtype} {shared.size}; {layers} layers of {n} tokens "
                f"({heads} heads x {dim} of {offer.dtype}) need uint8 [{nbytes}]"
            )
        t0 = time.monotonic()
        try:
            src = open_shared(shared, device)
        except ValueError as exc:
            raise KvTransferError(f"the offered device buffer cannot be opened safely: {exc}") from exc
        except RuntimeError as exc:  # CUDA's error: the exporter exited or freed the buffer
            raise KvPullError(
                f"the offer's device buffer could not be opened (its engine exited or released it): {exc}; "
                "nothing was installed",
                502,
            ) from exc
        try:
            with torch.cuda.device(src.device):
                # read after the exporter's copies (this stream waits on its event), then once more after
                # ours: a buffer released meanwhile has its id zeroed before it is freed
                _check_stamp(src[-STAMP_BYTES:].cpu().numpy(), offer.offer_id)
                out = [
                    src[p * plane : (p + 1) * plane].view(dtype).view(1, heads, n, dim).clone()
                    for p in range(2 * layers)
                ]
                _check_stamp(src[-STAMP_BYTES:].cpu().numpy(), offer.offer_id)
                torch.cuda.current_stream().synchronize()
        except KvPullError:
            raise
        except RuntimeError as exc:  # CUDA's error (out of memory among them)
            raise KvPullError(
                f"copying the offer's device buffer failed: {exc}; nothing was installed", 502
            ) from exc
        finally:
            del src  # torch gives the exporter its reference back once this process drops the mapping
        kv = RowKV(out[0::2], out[1::2])
        nb = -(-n // bt)
        blocks = tuple(BlockResult(b, b, EntryStatus.OK) for b in range(nb))
        return kv, KvTransferResult(blocks, time.monotonic() - t0, 2 * layers * plane)

    def close(self) -> None:
        with self._lock:
            offers, self._offers = list(self._offers.values()), {}
            subs, self._subscribers = list(self._subscribers.values()), {}
            by_kind, self._transports = self._transports, {}
            spares, self._spares = self._spares, []
        transports = list(by_kind.values())
        for o in offers:
            o.close()
        for k, r in spares:
            by_kind[k].unregister(r)
        for s in subs:
            s.close()
        for t in transports:
            t.close()


def buf_nbytes(layers: int, plane: int) -> int:
    """Bytes of a CUDA IPC offer's buffer: K and V planes of `plane` bytes per layer, then the offer id."""
    return 2 * layers * plane + STAMP_BYTES


def offer_transport(offer: PrefixOffer) -> str:
    """How `offer`'s KV moves: "cuda_ipc", else its gyre-xfer pool's transport ("shm", "mooncake")."""
    if offer.cuda_ipc is not None:
        return "cuda_ipc"
    return msgspec.json.decode(offer.kv_offer, type=KvOffer).pool.transport.name.lower()


def _pull_failed(res: KvTransferResult, peer: str, nb: int) -> KvPullError:
    bad = [b for b in res.blocks if b.status is not EntryStatus.OK]
    seen = {b.status for b in bad}
    status = 504 if EntryStatus.TIMEOUT in seen and EntryStatus.PEER_GONE not in seen else 502
    return KvPullError(
        f"prefix transfer from {peer} failed after {res.elapsed_s:.2f} s: {len(bad)} of {nb} blocks did "
        f"not arrive ({', '.join(sorted(s.name for s in seen))}; "
        f"{', '.join(f'{b.src_block}->{b.dst_block}:{b.status.name}' for b in bad[:16])})"
        f"{': ' + res.detail if res.detail else ''}; nothing was installed",
        status,
    )


def snapshot_tensors(snap: Snapshot, model: torch.nn.Module, layout: str) -> dict[str, torch.Tensor]:
    """The snapshot's tensors under the model's names, as torch views of the staging buffer (converted
    from Megatron-core's layout first when `layout == "megatron"`)."""
    if layout == "transformers":
        return dict(snap.torch())
    c = model.config.get_text_config()  # type: ignore[union-attr,operator]
    heads, kv_heads = int(c.num_attention_heads), int(c.num_key_value_heads)
    head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
    arrays = megatron_to_hf(heads, kv_heads, head_dim)(snap.arrays)
    bf16 = any(t.dtype == "bfloat16" for t in snap.manifest.tensors)
    out = {}
    for name, arr in arrays.items():
        t = torch.from_numpy(np.ascontiguousarray(arr))
        out[name] = t.view(torch.bfloat16) if bf16 and arr.dtype == np.uint16 else t
    return out


def block_reports(res: KvTransferResult) -> list[BlockReport]:
    return [BlockReport(b.src_block, b.dst_block, b.status.name) for b in res.blocks]


def xfer_status(exc: XferError) -> tuple[int, str, bool]:
    """HTTP status, error type and retryable flag for a gyre-xfer error."""
    from gyre_xfer.errors import (
        ChecksumError,
        SnapshotOverwrittenError,
        TransportUnavailableError,
    )

    table: list[tuple[type[XferError], int, bool]] = [
        (PeerGoneError, 502, True),
        (PeerTimeoutError, 504, True),
        (SnapshotOverwrittenError, 409, True),
        (ChecksumError, 502, True),
        (TransportUnavailableError, 503, False),
    ]
    for cls, status, retry in table:
        if isinstance(exc, cls):
            return status, type(exc).__name__, retry
    return 400, type(exc).__name__, False


def _whole_blocks(body: OfferPrefixRequest, n: int) -> OfferPrefixRequest:
    """`body` with `block_tokens` at most the `n` tokens offered (a larger block holds the same one
    block, and its bytes could not be counted in C); KvTransferError below 1."""
    if body.block_tokens < 1:
        raise KvTransferError("block_tokens must be at least 1")
    if body.block_tokens <= n:
        return body
    return msgspec.structs.replace(body, block_tokens=max(n, 1))
