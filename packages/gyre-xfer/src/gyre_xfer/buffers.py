"""Raw views of the buffers gyre-xfer moves: numpy arrays always, torch tensors (CPU or CUDA) when torch is present.

A buffer is described by its address, byte length, dtype name, shape and device; dtype names are torch's
spellings ("bfloat16", "float32", ...), and numpy holds bfloat16 as its raw 16-bit words (uint16).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import ShapeMismatchError

# dtype name -> (itemsize, numpy dtype that holds its bytes)
DTYPES: dict[str, tuple[int, np.dtype[Any]]] = {
    "bool": (1, np.dtype(np.bool_)),
    "uint8": (1, np.dtype(np.uint8)),
    "int8": (1, np.dtype(np.int8)),
    "int16": (2, np.dtype(np.int16)),
    "uint16": (2, np.dtype(np.uint16)),
    "int32": (4, np.dtype(np.int32)),
    "uint32": (4, np.dtype(np.uint32)),
    "int64": (8, np.dtype(np.int64)),
    "uint64": (8, np.dtype(np.uint64)),
    "float16": (2, np.dtype(np.float16)),
    "bfloat16": (2, np.dtype(np.uint16)),
    "float32": (4, np.dtype(np.float32)),
    "float64": (8, np.dtype(np.float64)),
    "float8_e4m3fn": (1, np.dtype(np.uint8)),
    "float8_e5m2": (1, np.dtype(np.uint8)),
}


def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype name; raises ShapeMismatchError for an unknown name."""
    try:
        return DTYPES[dtype][0]
    except KeyError:
        raise ShapeMismatchError(f"unknown dtype {dtype!r}; known: {sorted(DTYPES)}") from None


def nbytes_of(dtype: str, shape: tuple[int, ...]) -> int:
    return itemsize(dtype) * math.prod(shape)


@dataclass(frozen=True, slots=True)
class BufferView:
    """Where a buffer's bytes are, and what they mean."""

    addr: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    device: str  # "cpu" or "cuda:N"
    owner: object  # keeps the underlying memory alive while the view is used


def _torch_dtype_name(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


def view_of(buf: Any, dtype: str | None = None) -> BufferView:
    """Describe a C-contiguous numpy array or torch tensor. `dtype` overrides the array's own
    (say "bfloat16" for a numpy uint16 array that holds bf16 words)."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ShapeMismatchError("numpy buffer must be C-contiguous")
        name = dtype or buf.dtype.name
        if name not in DTYPES:
            raise ShapeMismatchError(f"unsupported numpy dtype {buf.dtype}")
        if DTYPES[name][0] != buf.dtype.itemsize:
            raise ShapeMismatchError(
                f"dtype {name} needs {DTYPES[name][0]}-byte items, array has {buf.dtype}"
            )
        return BufferView(buf.ctypes.data, buf.nbytes, name, tuple(buf.shape), "cpu", buf)
    mod = type(buf).__module__
    if mod.startswith("torch"):
        if not buf.is_contiguous():
            raise ShapeMismatchError("torch buffer must be contiguous")
        name = dtype or _torch_dtype_name(buf)
        if name not in DTYPES:
            raise ShapeMismatchError(f"unsupported torch dtype {buf.dtype}")
        dev = "cpu" if buf.device.type == "cpu" else f"{buf.device.type}:{buf.device.index or 0}"
        return BufferView(buf.data_ptr(), buf.numel() * buf.element_size(), name, tuple(buf.shape), dev, buf)
    raise ShapeMismatchError(f"expected a numpy array or torch tensor, got {type(buf).__name__}")


def numpy_view(raw: np.ndarray, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Interpret a uint8 numpy slice as `dtype` of `shape` (bfloat16 stays as uint16 words)."""
    return raw.view(DTYPES[dtype][1]).reshape(shape)


def torch_view(raw: np.ndarray, dtype: str, shape: tuple[int, ...]) -> Any:
    """The same bytes as a torch CPU tensor (shares memory), with the true dtype, bfloat16 included."""
    try:
        import torch
    except ImportError:
        raise ImportError("torch views need torch: pip install 'gyre-xfer[torch]'") from None
    t = torch.from_numpy(raw)  # uint8, shares memory
    return t.view(getattr(torch, dtype)).reshape(shape)
