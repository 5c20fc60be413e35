"""Page-locking memory that torch did not allocate (a shared-memory mapping), so that copies between it
and a GPU run at full PCIe/NVLink speed and can be asynchronous. `pin` is a no-op (False) without CUDA
or when the driver refuses; callers then copy from pageable memory, which is only slower.
"""

from __future__ import annotations

import torch


def _code(err: object) -> int:
    return int(getattr(err, "value", err))  # type: ignore[call-overload]


def pin(t: torch.Tensor) -> bool:
    """Register `t`'s host memory with CUDA (cudaHostRegister). True if this call page-locked it (then
    `unpin` it before the memory goes away); False without CUDA, if the driver refused, or if it was
    page-locked already."""
    if t.device.type != "cpu" or not torch.cuda.is_available() or t.numel() == 0:
        return False
    if t.is_pinned():
        return False
    torch.cuda.init()
    return _code(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)) == 0


def unpin(t: torch.Tensor) -> None:
    """Undo a `pin` that returned True (before the memory is unmapped)."""
    if torch.cuda.is_available() and t.numel():
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
