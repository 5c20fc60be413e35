"""A micro-batch gradient from the rank that computed it to the core rank that sums it, through gyre-xfer.

The sender keeps the gradient, already in the wire dtype, in a region registered with its gyre-xfer
transport (`GradStaging`; one slot per micro-batch it may hold at once) and names it in the ZeroMQ
`Gradient` header as a `GradShard`: endpoint, region, byte offset, dtype, element count and the buckets
that tile it. The receiver checks the description against what it expects (`check_shard`), reads every
bucket into its own registered landing region (`GradReader`; one batched transfer, one entry per bucket)
and returns a view of it, still in the wire dtype. Only the header crosses ZeroMQ; the bytes move over
Mooncake (TCP here, RDMA on clusters) or, on one host, shared memory. A malformed description is a
`BadShardError` (nothing was read); a transfer that fails is a `ShardTransferError` (the landing region
holds a mix: nothing may use it).
"""

from __future__ import annotations

import torch
from gyre_xfer.errors import XferError
from gyre_xfer.transport import Op, Region, Transport

from gyre_train import hostmem
from gyre_train.protocol import Bucket, GradShard

WIRE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""The dtypes a gradient may be handed over in. float32 moves the computed gradient as it is; bfloat16
rounds it once (to nearest even) where it is computed and halves the bytes."""

DEFAULT_BUCKET_BYTES = 64 << 20


class HandoffError(RuntimeError):
    """A gradient shard could not be handed over."""


class BadShardError(HandoffError):
    """A shard description that does not fit what the receiver expects (dtype, size, buckets, range)."""


class ShardTransferError(HandoffError):
    """The transport failed to move a shard (peer gone, timed out, refused)."""


def wire_dtype(name: str) -> torch.dtype:
    """The torch dtype of a wire dtype name; ValueError for any other name."""
    try:
        return WIRE_DTYPES[name]
    except KeyError:
        raise ValueError(f"wire dtype {name!r} is not one of {sorted(WIRE_DTYPES)}") from None


def plan_buckets(numel: int, itemsize: int, bucket_bytes: int) -> tuple[Bucket, ...]:
    """Consecutive buckets of at most `bucket_bytes` covering [0, numel) (none for an empty shard)."""
    per = max(1, bucket_bytes // itemsize)
    return tuple(Bucket(lo, min(per, numel - lo)) for lo in range(0, numel, per))


def check_shard(shard: GradShard, numel: int, dtype: str) -> None:
    """BadShardError unless `shard` describes `numel` elements of `dtype` inside its region, in buckets
    that tile [0, numel) in order."""
    if shard.dtype != dtype:
        raise BadShardError(f"rank {shard.rank}: gradient in {shard.dtype!r}, the core takes {dtype!r}")
    if shard.numel != numel:
        raise BadShardError(f"rank {shard.rank}: shard of {shard.numel} elements, expected {numel}")
    itemsize = WIRE_DTYPES[dtype].itemsize
    if shard.offset < 0 or shard.offset + numel * itemsize > shard.region.nbytes:
        raise BadShardError(
            f"rank {shard.rank}: bytes [{shard.offset}, {shard.offset + numel * itemsize}) are not inside "
            f"the sender's region of {shard.region.nbytes}"
        )
    at = 0
    for b in shard.buckets:
        if b.offset != at or b.numel <= 0:
            raise BadShardError(f"rank {shard.rank}: buckets do not tile the shard in order at element {at}")
        at += b.numel
    if at != numel:
        raise BadShardError(f"rank {shard.rank}: buckets cover {at} of {numel} elements")


class GradStaging:
    """The sender's side: `slots` gradient shards of `numel` elements in the wire dtype, in one region
    registered with `transport` (page-locked when `pin`, so a GPU copies into it at full speed)."""

    def __init__(
        self,
        transport: Transport,
        numel: int,
        dtype: str,
        slots: int = 1,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        pin: bool = False,
    ) -> None:
        self.transport = transport
        self.numel = numel
        self.dtype = dtype
        self.torch_dtype = wire_dtype(dtype)
        self.slots = slots
        self._stride = numel * self.torch_dtype.itemsize
        self.region: Region = transport.alloc(max(1, slots * self._stride))
        arr = self.region.array
        assert arr is not None
        self._buf = torch.from_numpy(arr[: slots * self._stride]).view(self.torch_dtype)
        self._pinned = pin and hostmem.pin(self._buf)
        self.buckets = plan_buckets(numel, self.torch_dtype.itemsize, bucket_bytes)

    def slot(self, k: int) -> torch.Tensor:
        """Slot `k` as a flat tensor of the wire dtype (write the gradient here)."""
        return self._buf[k * self.numel : (k + 1) * self.numel]

    def describe(self, k: int, rank: int) -> GradShard:
        """What the header says about slot `k` for core rank `rank`."""
        return GradShard(
            rank,
            self.transport.endpoint,
            self.region.desc,
            k * self._stride,
            self.dtype,
            self.numel,
            self.buckets,
        )

    def close(self) -> None:
        if self._pinned:
            hostmem.unpin(self._buf)
            self._pinned = False
        self.transport.unregister(self.region)


class GradReader:
    """The receiver's side: one landing region of `numel` elements of the wire dtype, registered with
    `transport`; `read` fills it from a sender's shard and returns it (valid until the next read)."""

    def __init__(self, transport: Transport, numel: int, dtype: str, pin: bool = False) -> None:
        self.transport = transport
        self.numel = numel
        self.dtype = dtype
        self.torch_dtype = wire_dtype(dtype)
        self._pin = pin
        self._pinned = False
        self._allocate()
        self.bytes_read = 0

    def _allocate(self) -> None:
        nbytes = self.numel * self.torch_dtype.itemsize
        self.region: Region = self.transport.alloc(max(1, nbytes))
        arr = self.region.array
        assert arr is not None
        self._landing = torch.from_numpy(arr[:nbytes]).view(self.torch_dtype)
        self._pinned = self._pin and hostmem.pin(self._landing)

    def read(self, shard: GradShard, timeout_s: float | None = None) -> torch.Tensor:
        """Read `shard`'s buckets (checked first) into the landing region in one batched transfer."""
        check_shard(shard, self.numel, self.dtype)
        isz = self.torch_dtype.itemsize
        ops = [
            Op(self.region, b.offset * isz, shard.region, shard.offset + b.offset * isz, b.numel * isz)
            for b in shard.buckets
        ]
        try:
            result = self.transport.read(shard.endpoint, ops, timeout_s)
            result.raise_for_status(shard.endpoint, f"gradient shard of rank {shard.rank}")
        except XferError as exc:
            # Slices of a failed Mooncake batch may still land for a while (gyre-xfer keeps the memory
            # alive meanwhile): read the next shard into a fresh region, never into this one.
            if self._pinned:
                hostmem.unpin(self._landing)
            self._allocate()
            raise ShardTransferError(str(exc)) from exc
        self.bytes_read += self.numel * isz
        return self._landing

    def close(self) -> None:
        if self._pinned:
            hostmem.unpin(self._landing)
            self._pinned = False
        self.transport.unregister(self.region)
