"""Device memory whose addresses outlive a release: the engine's weights and its slots' KV buffers, so that
`release_memory_occupation` frees their memory while the engine's CUDA graphs stay valid.

Why: a captured CUDA graph holds the device addresses of everything its kernels read and write (the
weights, the KV buffer, its own activations). A release that frees the weights and the KV buffer and a
resume that allocates them again at other addresses leaves every graph useless: the engine then captured
its decode graphs again after each switch back to rollout, 0.4-1 s each, a third of the core's engine's
busy rollout time on `examples/h200-shared.toml` on one H100 (18 captures, 7.8 s of 21.6 s: integration's
`bench/results-h100-run-tls.json`). With the addresses kept it captures none after a switch back (on one
H200: 0 against 18 captures and 6.4 s, `bench/results-h200-run.json` against `results-h200-run-nokeep.json`).

How: CUDA's virtual memory management (the driver's `cuMemAddressReserve`, `cuMemCreate`, `cuMemMap`).
A `DeviceRegion` reserves a range of device addresses once, for the life of the engine, and maps
physical memory into it; `unmap()` gives the physical memory back to the driver (another engine or a
trainer on the GPU can have it) and keeps the addresses; `map()` maps new physical memory at the same
addresses. The tensors over a region (`tensor()`) keep their addresses across both, so the graphs
captured over them replay as before once it is mapped again (their contents are whatever is copied in:
the weights from the host, the KV buffer zeroed). The graphs' own memory pools stay allocated while
released (the activations of a decode step: megabytes).

`KeptWeights` moves a model's parameters and buffers (and any other tensors that share their storage,
such as the fused projections' weights) into one region, keeping each tensor's layout in its storage;
`release()` copies the region into one page-locked host buffer, points the tensors at their places in it
and unmaps; `restore()` maps, copies back and points them at the same device addresses as before.

Only where the driver supports it (`supported(device)`: CUDA with virtual memory management); elsewhere
the engine frees and allocates as before. The driver is reached through ctypes (libcuda), with no other
dependency; every call's error is raised as `VmemError` with the driver's name for it, and an
out-of-memory `map()` as `torch.OutOfMemoryError`, as an allocation would.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Iterable
from typing import Any

import torch

log = logging.getLogger(__name__)

_ALLOCATION_TYPE_PINNED = 1  # CU_MEM_ALLOCATION_TYPE_PINNED: memory on the device, not migratable
_LOCATION_TYPE_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
_ACCESS_READWRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
_GRANULARITY_RECOMMENDED = 1  # CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
_ATTR_VMM_SUPPORTED = 102  # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
_OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY
_ALIGN = 256
"""Byte alignment of each storage inside a region (what the caching allocator gives at least)."""


class VmemError(RuntimeError):
    """A CUDA driver call of the virtual memory API failed."""


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_U64, _SIZE, _INT, _P = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, ctypes.POINTER
_SIGNATURES: dict[str, list[Any]] = {
    "cuGetErrorName": [_INT, _P(ctypes.c_char_p)],
    "cuCtxGetCurrent": [_P(ctypes.c_void_p)],
    "cuCtxSetCurrent": [ctypes.c_void_p],
    "cuDeviceGet": [_P(_INT), _INT],
    "cuDeviceGetAttribute": [_P(_INT), _INT, _INT],
    "cuDevicePrimaryCtxRetain": [_P(ctypes.c_void_p), _INT],
    "cuDevicePrimaryCtxRelease": [_INT],
    "cuMemGetAllocationGranularity": [_P(_SIZE), _P(_AllocationProp), _INT],
    "cuMemAddressReserve": [_P(_U64), _SIZE, _SIZE, _U64, _U64],
    "cuMemAddressFree": [_U64, _SIZE],
    "cuMemCreate": [_P(_U64), _SIZE, _P(_AllocationProp), _U64],
    "cuMemRelease": [_U64],
    "cuMemMap": [_U64, _SIZE, _SIZE, _U64, _U64],
    "cuMemUnmap": [_U64, _SIZE],
    "cuMemSetAccess": [_U64, _SIZE, _P(_AccessDesc), _SIZE],
}
"""The driver functions used here, with their argument types (cuda.h; the CUresult they return is an int)."""

_lib: Any = None
_lib_lock = threading.Lock()


def _driver() -> Any:
    """libcuda through ctypes (loaded once, its functions typed), or VmemError."""
    global _lib
    with _lib_lock:
        if _lib is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
                for name, args in _SIGNATURES.items():
                    fn = getattr(lib, name)
                    fn.argtypes, fn.restype = args, _INT
            except (OSError, AttributeError) as exc:
                raise VmemError(f"the CUDA driver library (libcuda.so.1) is not usable: {exc}") from exc
            _lib = lib
        return _lib


def _check(code: int, what: str) -> None:
    if code == 0:
        return
    name = ctypes.c_char_p()
    _driver().cuGetErrorName(code, ctypes.byref(name))
    label = name.value.decode() if name.value else f"CUresult {code}"
    if code == _OUT_OF_MEMORY:
        raise torch.OutOfMemoryError(f"{what}: {label}")
    raise VmemError(f"{what}: {label}")


def _ordinal(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _make_current(device: torch.device) -> None:
    """Make the device's primary context (torch's) current on this thread, as the driver API needs."""
    lib = _driver()
    torch.cuda.init()
    ctx = ctypes.c_void_p()
    _check(lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    dev = ctypes.c_int()
    _check(lib.cuDeviceGet(ctypes.byref(dev), _ordinal(device)), "cuDeviceGet")
    primary = ctypes.c_void_p()
    _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(primary), dev), "cuDevicePrimaryCtxRetain")
    try:
        if ctx.value != primary.value:
            _check(lib.cuCtxSetCurrent(primary), "cuCtxSetCurrent")
    finally:
        _check(lib.cuDevicePrimaryCtxRelease(dev), "cuDevicePrimaryCtxRelease")


def supported(device: torch.device) -> bool:
    """Whether regions can be made on `device`: CUDA, the driver loadable, virtual memory management on."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        lib = _driver()
        dev = ctypes.c_int()
        _check(lib.cuDeviceGet(ctypes.byref(dev), _ordinal(device)), "cuDeviceGet")
        value = ctypes.c_int()
        _check(
            lib.cuDeviceGetAttribute(ctypes.byref(value), _ATTR_VMM_SUPPORTED, dev), "cuDeviceGetAttribute"
        )
    except VmemError as exc:
        log.warning("kept device addresses unavailable: %s", exc)
        return False
    return bool(value.value)


class _Raw:
    """What `torch.as_tensor` wraps: a range of device memory, by the CUDA array interface."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


class DeviceRegion:
    """A range of device addresses, reserved for this object's life, with physical memory mapped into it
    while `mapped` (see the module docstring)."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        if nbytes <= 0:
            raise ValueError(f"a region needs a positive size, not {nbytes}")
        self.device = torch.device("cuda", _ordinal(device))
        _make_current(self.device)
        lib = _driver()
        self._prop = _AllocationProp()
        self._prop.type = _ALLOCATION_TYPE_PINNED
        self._prop.location = _Location(_LOCATION_TYPE_DEVICE, self.device.index)
        gran = ctypes.c_size_t()
        _check(
            lib.cuMemGetAllocationGranularity(
                ctypes.byref(gran), ctypes.byref(self._prop), _GRANULARITY_RECOMMENDED
            ),
            "cuMemGetAllocationGranularity",
        )
        self.requested = nbytes
        self.nbytes = -(-nbytes // gran.value) * gran.value
        ptr = ctypes.c_uint64()
        _check(lib.cuMemAddressReserve(ctypes.byref(ptr), self.nbytes, 0, 0, 0), "cuMemAddressReserve")
        self.ptr = int(ptr.value)
        self._handle: int | None = None
        self._closed = False
        self.maps = 0
        """Times physical memory was mapped in (1 at creation, one more per `map` after an `unmap`)."""
        try:
            self.map()
        except BaseException:
            lib.cuMemAddressFree(self.ptr, self.nbytes)
            raise

    @property
    def mapped(self) -> bool:
        return self._handle is not None

    def map(self) -> None:
        """Back the addresses with new physical memory (no-op while mapped); torch.OutOfMemoryError if the
        device has too little free."""
        if self._closed:
            raise VmemError("the region is closed")
        if self._handle is not None:
            return
        _make_current(self.device)
        lib = _driver()
        handle = ctypes.c_uint64()
        _check(
            lib.cuMemCreate(ctypes.byref(handle), self.nbytes, ctypes.byref(self._prop), 0),
            f"cuMemCreate of {self.nbytes} bytes on {self.device}",
        )
        try:
            _check(lib.cuMemMap(self.ptr, self.nbytes, 0, handle.value, 0), "cuMemMap")
            access = _AccessDesc(_Location(_LOCATION_TYPE_DEVICE, self.device.index), _ACCESS_READWRITE)
            try:
                _check(lib.cuMemSetAccess(self.ptr, self.nbytes, ctypes.byref(access), 1), "cuMemSetAccess")
            except BaseException:
                lib.cuMemUnmap(self.ptr, self.nbytes)
                raise
        except BaseException:
            lib.cuMemRelease(handle.value)
            raise
        self._handle = int(handle.value)
        self.maps += 1

    def unmap(self) -> None:
        """Give the physical memory back to the driver, after the work queued on the device so far (no-op
        while unmapped). The addresses stay reserved; nothing may touch them until `map`."""
        if self._handle is None:
            return
        torch.cuda.synchronize(self.device)
        _make_current(self.device)
        lib = _driver()
        _check(lib.cuMemUnmap(self.ptr, self.nbytes), "cuMemUnmap")
        _check(lib.cuMemRelease(self._handle), "cuMemRelease")
        self._handle = None

    def tensor(self, dtype: torch.dtype, shape: Iterable[int], offset: int = 0) -> torch.Tensor:
        """A contiguous tensor over the region from byte `offset` (the region owns the memory: a tensor
        outliving `close`, or used while unmapped, reads freed addresses)."""
        shape = tuple(int(s) for s in shape)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        n = itemsize
        for s in shape:
            n *= s
        if offset % itemsize or offset < 0 or offset + n > self.requested:
            raise ValueError(f"{n} bytes at offset {offset} do not fit a region of {self.requested}")
        raw = torch.as_tensor(_Raw(self.ptr + offset, max(n, itemsize)), device=self.device)
        return raw[:n].view(dtype).view(shape)

    def close(self) -> None:
        """Unmap and free the addresses (after the device's queued work)."""
        if self._closed:
            return
        self.unmap()
        _check(_driver().cuMemAddressFree(self.ptr, self.nbytes), "cuMemAddressFree")
        self._closed = True


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of a region holding the storages of `tensors` (each once, aligned as `KeptWeights` places
    them)."""
    sizes: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        sizes.setdefault(st.data_ptr(), st.nbytes())
    return sum(_aligned(n) for n in sizes.values())


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class KeptWeights:
    """Tensors moved into one `DeviceRegion`, each keeping its layout inside its storage (views of one
    storage stay views of one place), so that a release and a restore bring them back at the same
    addresses (see the module docstring)."""

    def __init__(self, tensors: Iterable[torch.Tensor], device: torch.device) -> None:
        self.tensors: list[torch.Tensor] = []
        seen: set[int] = set()
        for t in tensors:
            if id(t) not in seen:
                seen.add(id(t))
                self.tensors.append(t)
        # one place per storage, in the order first met
        self._where: list[tuple[int, int]] = []
        """Per tensor: (the byte offset of its storage in the region, its storage's byte size)."""
        self._layout = [(tuple(t.shape), t.stride(), t.storage_offset()) for t in self.tensors]
        """Per tensor: its shape, strides and offset (in elements) inside its storage."""
        offsets: dict[int, int] = {}
        sizes: dict[int, int] = {}
        end = 0
        for t in self.tensors:
            if t.device.type != "cuda":
                raise ValueError(f"KeptWeights takes device tensors, not one on {t.device}")
            st = t.untyped_storage()
            key = st.data_ptr()
            if key not in offsets:
                offsets[key] = end
                sizes[key] = st.nbytes()
                end += _aligned(st.nbytes())
            self._where.append((offsets[key], sizes[key]))
        self.nbytes = end
        self.region = DeviceRegion(max(end, 1), device)
        self.host: torch.Tensor | None = None
        self.released = False
        with torch.no_grad():
            copied: set[int] = set()
            for t, (off, size) in zip(self.tensors, self._where, strict=True):
                if off not in copied:
                    copied.add(off)
                    src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
                    self.region.tensor(torch.uint8, (size,), off).copy_(src[:size])
        self._point(self._device_base)

    def _device_base(self, off: int, size: int) -> torch.Tensor:
        return self.region.tensor(torch.uint8, (size,), off)

    def _host_base(self, off: int, size: int) -> torch.Tensor:
        assert self.host is not None
        return self.host[off : off + size]

    def _point(self, base_of: Any) -> None:
        """Point every tensor at its place in the bytes `base_of(offset, size)` gives for its storage."""
        with torch.inference_mode(False):  # parameters the weight updates copy into outside inference mode
            for t, (off, size), (shape, stride, at) in zip(
                self.tensors, self._where, self._layout, strict=True
            ):
                base = base_of(off, size).view(t.dtype)
                t.data = base.as_strided(shape, stride, base.storage_offset() + at)

    def pin_host(self) -> None:
        """Allocate the page-locked host copy now (else at the first release)."""
        if self.host is None:
            self.host = torch.empty(max(self.nbytes, 1), dtype=torch.uint8, pin_memory=True)

    def release(self) -> None:
        """Copy the weights to the host copy, point the tensors at it and free the device memory."""
        if self.released:
            return
        self.pin_host()
        assert self.host is not None
        with torch.no_grad():
            self.host[: self.nbytes].copy_(self.region.tensor(torch.uint8, (self.nbytes,)), non_blocking=True)
        torch.cuda.synchronize(self.region.device)
        self._point(self._host_base)
        self.region.unmap()
        self.released = True

    def restore(self) -> None:
        """Map the device memory again, copy the weights back and point the tensors at their device
        addresses, the same as before the release (torch.OutOfMemoryError if the device lacks the room;
        the tensors then stay on the host)."""
        if not self.released:
            return
        assert self.host is not None
        self.region.map()
        with torch.no_grad():
            self.region.tensor(torch.uint8, (self.nbytes,)).copy_(self.host[: self.nbytes], non_blocking=True)
        torch.cuda.synchronize(self.region.device)
        self._point(self._device_base)
        self.released = False

    def close(self) -> None:
        self.region.close()
