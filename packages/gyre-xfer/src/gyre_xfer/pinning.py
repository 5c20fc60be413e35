"""Page-locking the host buffers that sit between gyre-xfer and a GPU: a subscriber's staging buffer (its
tensors then go to the device) and a publisher's slots (filled from device tensors).

A `Pinning` is handed each such buffer once, as its `Region`: `pin` right after the buffer is allocated,
`unpin` before it is released (when it is replaced by a larger one, and on close). `pin` raises
PinningError when it cannot; the subscriber or publisher then logs a warning and keeps the buffer
pageable, so copies are slower but the bytes are the same. `CudaHostPinning` registers the memory with
CUDA (cudaHostRegister), which makes host<->device copies run at full link speed and lets them be
asynchronous; `host_pinning(device)` gives one for a CUDA device and None for the CPU, where nothing is
gained. torch is imported only when a CudaHostPinning is made (the `torch` extra).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from .errors import XferError
from .transport import Region, Transport

_log = logging.getLogger(__name__)

_PORTABLE = 1
"""cudaHostRegisterPortable: page-locked for every CUDA context of the process, not only the current one."""


class PinningError(XferError):
    """A buffer could not be page-locked; it stays pageable."""


class Pinning(Protocol):
    """Page-locks host buffers for their lifetime."""

    def pin(self, region: Region) -> None:
        """Page-lock `region`'s memory, or raise PinningError (then it stays pageable)."""
        ...

    def unpin(self, region: Region) -> None:
        """Undo a `pin` that succeeded, before the memory goes away."""
        ...


class CudaHostPinning:
    """Registers host regions with CUDA (cudaHostRegister, portable), on the given device's context."""

    def __init__(self, device: str = "cuda") -> None:
        try:
            import torch
        except ImportError:
            raise PinningError("page-locking needs torch: pip install 'gyre-xfer[torch]'") from None
        if not torch.cuda.is_available():
            raise PinningError("page-locking needs CUDA, and no CUDA device is available")
        self._torch: Any = torch
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise PinningError(f"page-locking is for CUDA devices, not {device!r}")

    def pin(self, region: Region) -> None:
        if region.device != "cpu" or region.array is None:
            raise PinningError(f"region {region.desc.region_id} is not host memory ({region.device})")
        self.pin_range(region.addr, region.nbytes)

    def unpin(self, region: Region) -> None:
        self.unpin_range(region.addr, region.nbytes)

    def pin_range(self, addr: int, nbytes: int) -> None:
        """Page-lock the host memory [addr, addr + nbytes), or raise PinningError. The range must not
        share a page with memory pinned by another call (cudaHostRegister refuses a page twice): give it
        a buffer of its own."""
        if nbytes == 0:
            return
        self._torch.cuda.init()
        code = self._call(lambda cudart: cudart.cudaHostRegister(addr, nbytes, _PORTABLE))
        if code != 0:
            raise PinningError(f"cudaHostRegister of {nbytes} bytes at {addr:#x} returned cudaError {code}")

    def unpin_range(self, addr: int, nbytes: int) -> None:
        """Undo a `pin_range(addr, nbytes)` that succeeded, before the memory goes away."""
        if nbytes == 0:
            return
        code = self._call(lambda cudart: cudart.cudaHostUnregister(addr))
        if code != 0:
            raise PinningError(f"cudaHostUnregister at {addr:#x} returned cudaError {code}")

    def _call(self, fn: Callable[[Any], object]) -> int:
        """fn(torch's cudart) on a thread of its own, on this device; its cudaError as an int. A failing
        call also becomes the CUDA runtime's "last error" of the thread that made it, which torch raises
        at that thread's next kernel launch (seen on the H200), and torch offers no way to reset it: the
        helper thread takes that error with it."""
        torch = self._torch
        codes: list[int] = []

        def run() -> None:
            with torch.cuda.device(self.device):
                codes.append(_code(fn(torch.cuda.cudart())))

        helper = threading.Thread(target=run, name="gyre-xfer-pin")
        helper.start()
        helper.join()
        if not codes:
            raise PinningError("the CUDA registration call raised (its traceback is in the log)")
        return codes[0]


def pin_or_keep_pageable(
    pinning: Pinning | None, region: Region, what: str, log: logging.Logger
) -> Pinning | None:
    """Page-lock `region` with `pinning`; the pinning now holding it, or None when there is none or it
    refused (logged on `log`, naming `what`: the buffer stays pageable, its copies slower)."""
    if pinning is None:
        return None
    try:
        pinning.pin(region)
    except PinningError as e:
        log.warning(
            "gyre-xfer: %s of %d bytes stays pageable (copies are slower): %s", what, region.nbytes, e
        )
        return None
    return pinning


def unpin_and_unregister(
    transport: Transport, region: Region, pinned_by: Pinning | None, what: str, log: logging.Logger
) -> None:
    """Release a buffer from `pin_or_keep_pageable`: unpinned first, while it is still mapped (a failure
    logged on `log`), then unregistered from `transport` in any case."""
    try:
        if pinned_by is not None:
            pinned_by.unpin(region)
    except PinningError as e:
        log.warning("gyre-xfer: unpinning the %s failed: %s", what, e)
    finally:
        transport.unregister(region)


def host_pinning(device: object) -> Pinning | None:
    """A CudaHostPinning for a CUDA device ("cuda", "cuda:1", a torch.device); None for any other (a
    CPU consumer gains nothing from page-locked memory), or when CUDA cannot be used (logged)."""
    name = str(device)
    if not name.startswith("cuda"):
        return None
    try:
        return CudaHostPinning(name)
    except PinningError as e:
        _log.warning("gyre-xfer: host buffers for %s stay pageable: %s", name, e)
        return None


def _code(err: object) -> int:
    """A cudaError as an int (torch returns an enum member with `.value`)."""
    return int(getattr(err, "value", err))  # type: ignore[call-overload]
