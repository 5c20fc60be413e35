"""What of `server/vmem.py` runs without a GPU: the driver structs' layout (cuda.h's, on 64-bit Linux),
and the engine falling back to freeing and allocating where the driver's virtual memory API is absent."""

from __future__ import annotations

import ctypes

import pytest

torch = pytest.importorskip("torch")

from gyre_engine.server import vmem  # noqa: E402


def test_driver_structs_match_cuda_h() -> None:
    # CUmemAllocationProp: type, requestedHandleTypes, location {type, id}, win32HandleMetaData,
    # allocFlags {compressionType, gpuDirectRDMACapable, usage, reserved[4]}
    assert ctypes.sizeof(vmem._AllocationProp) == 32
    assert vmem._AllocationProp.location.offset == 8
    assert vmem._AllocationProp.win32HandleMetaData.offset == 16
    assert vmem._AllocationProp.allocFlags.offset == 24
    assert ctypes.sizeof(vmem._AccessDesc) == 12  # CUmemAccessDesc: location, flags


def test_no_regions_off_cuda() -> None:
    assert not vmem.supported(torch.device("cpu"))


def test_storage_bytes_counts_each_storage_once_aligned() -> None:
    base = torch.zeros(100, dtype=torch.float32)  # 400 bytes -> 512
    views = [base, base[10:], base.view(10, 10).t()]
    other = torch.zeros(3, dtype=torch.bfloat16)  # 6 bytes -> 256
    assert vmem.storage_bytes([*views, other, other]) == 512 + 256
    assert vmem.storage_bytes([]) == 0
