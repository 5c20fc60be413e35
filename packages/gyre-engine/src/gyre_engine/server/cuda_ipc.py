"""A CUDA tensor shared with another process on the same GPU through torch's CUDA IPC, described by a
msgspec record (`protocol.CudaIpcTensor`), never a pickle.

Exporting: `share(t)` runs `torch.multiprocessing.reductions.reduce_tensor` and keeps the plain values of
the arguments it gives for `rebuild_cuda_tensor`, with the GPU's UUID. torch then wraps the storage: once
the exporter drops its tensor, the memory stays allocated while the share's reference counter (a slot in a
shared-memory file, set to 1 for the one importer it expects) is above zero; the importer decrements it
when it drops the tensor it rebuilt. `forgo(desc)` decrements it on the importer's behalf, for a share the
importer did not open or may have given up on, so that memory does not stay allocated until the exporter
exits. The share also records an interprocess CUDA event after the work queued so far on the exporter's
current stream: the importer's stream waits on it (`event_sync_required`; torch synchronizes the
exporter's stream instead once it has many events outstanding).

Importing: `open_shared(desc, device)` refuses a device other than the exporter's GPU
(`CudaIpcUnreachable`) and otherwise rebuilds the tensor with `rebuild_cuda_tensor`, on this process's
index of that GPU. Copy out of it and drop it at once: while it lives, the exporter's memory does.

Allocating: torch cannot share memory of expandable segments between processes, and the engine's
caching allocator uses them; `shareable_allocations()` turns them off for the allocations made inside it
(on the engine thread, between two steps, so the engine's own allocations do not see the change; an
import running meanwhile on another thread of the process merely gets plain segments).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from gyre_engine.protocol import CudaIpcTensor

IPC_HANDLE_BYTES = 64
"""Size of a CUDA IPC event handle (CUDA_IPC_HANDLE_SIZE): torch reads that many bytes from it."""


class CudaIpcUnreachable(Exception):
    """A CUDA IPC share this process cannot open: it is not on the exporter's GPU (or not on a GPU)."""


def device_uuid(device: torch.device) -> str:
    """The GPU's identity, the same in every process that sees it (whatever its index there)."""
    return str(torch.cuda.get_device_properties(device).uuid)


def expandable_segments(settings: str) -> bool:
    """Whether the caching allocator's settings (PYTORCH_CUDA_ALLOC_CONF's syntax) turn them on."""
    for item in settings.split(","):
        key, _, value = item.partition(":")
        if key.strip() == "expandable_segments":
            return value.strip().lower() == "true"
    return False


def allocator_settings() -> str:
    """The caching allocator's settings now: torch's own answer where this build has it, else what the
    process started with (PYTORCH_CUDA_ALLOC_CONF, which `gyre-engine serve` sets before CUDA starts)."""
    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    return str(get()) if get is not None else os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")


def set_allocator_settings(settings: str) -> None:
    """Change the caching allocator's settings (torch's accelerator call, or the CUDA one of older builds)."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or getattr(
        torch._C, "_cuda_cudaCachingAllocator_set_allocator_settings", None
    )
    if setter is None:
        raise RuntimeError(f"torch {torch.__version__} has no call to change the CUDA allocator's settings")
    setter(settings)


@contextlib.contextmanager
def shareable_allocations() -> Iterator[None]:
    """Allocations inside come from plain cudaMalloc segments, which CUDA IPC can share (expandable
    segments turned off meanwhile, if they were on)."""
    previous = allocator_settings()
    if not expandable_segments(previous):
        yield
        return
    set_allocator_settings("expandable_segments:False")
    try:
        yield
    finally:
        set_allocator_settings(previous)


def share(t: torch.Tensor) -> CudaIpcTensor:
    """Describe `t` (a CUDA tensor from `shareable_allocations`) for one importer. Keep `t` alive until
    that importer is done (or `forgo` its reference): the memory is freed once neither holds it."""
    if type(t) is not torch.Tensor or t.device.type != "cuda" or t.requires_grad:
        raise ValueError(
            f"only a plain CUDA tensor without grad can be shared, not a {type(t)} on {t.device}"
        )
    rebuild, args = reduce_tensor(t)  # from here on torch holds the storage for one importer
    if rebuild is not rebuild_cuda_tensor:
        raise ValueError(f"torch reduces this tensor with {rebuild!r}, not rebuild_cuda_tensor")
    (
        _tensor_cls,
        size,
        stride,
        tensor_offset,
        _storage_cls,
        dtype,
        _device,  # the exporter's index of the GPU: the importer passes its own
        handle,
        storage_size_bytes,
        storage_offset_bytes,
        _requires_grad,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = args
    return CudaIpcTensor(
        device_uuid=device_uuid(t.device),
        size=[int(s) for s in size],
        stride=[int(s) for s in stride],
        tensor_offset=int(tensor_offset),
        dtype=str(dtype).removeprefix("torch."),
        storage_handle=bytes(handle),
        storage_size_bytes=int(storage_size_bytes),
        storage_offset_bytes=int(storage_offset_bytes),
        ref_counter_handle=bytes(ref_counter_handle).decode("ascii"),
        ref_counter_offset=int(ref_counter_offset),
        event_handle=bytes(event_handle),
        event_sync_required=bool(event_sync_required),
    )


def forgo(desc: CudaIpcTensor) -> None:
    """Drop the reference `share` set aside for the importer (in the exporter, before it drops its own
    tensor): for a share never opened, or one whose importer may have given up. An importer that did open
    it decrements the counter again when it drops its tensor, which torch reads as nothing held."""
    torch.UntypedStorage._release_ipc_counter(
        desc.ref_counter_handle.encode("ascii"), desc.ref_counter_offset
    )


def open_shared(desc: CudaIpcTensor, device: torch.device) -> torch.Tensor:
    """The tensor `desc` describes, mapped into this process on `device`. ValueError for a description
    torch could not use safely (checked first, wherever this runs); CudaIpcUnreachable unless `device` is
    the exporter's GPU; RuntimeError from CUDA when the share cannot be opened (its exporter exited, or
    freed the memory)."""
    dtype = getattr(torch, desc.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {desc.dtype!r}")
    if len(desc.size) != len(desc.stride):
        raise ValueError(f"size {desc.size} and stride {desc.stride} differ in rank")
    if len(desc.event_handle) != IPC_HANDLE_BYTES or len(desc.storage_handle) < IPC_HANDLE_BYTES:
        raise ValueError("malformed CUDA IPC handles")
    last = desc.tensor_offset + sum((s - 1) * st for s, st in zip(desc.size, desc.stride, strict=True))
    if all(desc.size) and (last + 1) * dtype.itemsize > desc.storage_size_bytes:
        raise ValueError(f"the tensor runs past its storage of {desc.storage_size_bytes} bytes")
    if device.type != "cuda":
        raise CudaIpcUnreachable(
            f"the offer is in the memory of GPU {desc.device_uuid}; this engine is on {device}"
        )
    mine = device_uuid(device)
    if mine != desc.device_uuid:
        raise CudaIpcUnreachable(
            f"the offer is in the memory of GPU {desc.device_uuid}; this engine is on {mine}"
        )
    index = device.index if device.index is not None else torch.cuda.current_device()
    with torch.cuda.device(index):
        t: torch.Tensor = rebuild_cuda_tensor(
            torch.Tensor,
            torch.Size(desc.size),
            tuple(desc.stride),
            desc.tensor_offset,
            torch.storage.TypedStorage,
            dtype,
            index,
            desc.storage_handle,
            desc.storage_size_bytes,
            desc.storage_offset_bytes,
            False,
            desc.ref_counter_handle.encode("ascii"),
            desc.ref_counter_offset,
            desc.event_handle,
            desc.event_sync_required,
        )
    return t
