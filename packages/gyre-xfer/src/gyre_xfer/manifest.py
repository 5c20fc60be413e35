"""Snapshot manifests: lay out named tensors in one registered slot, and check a received manifest
before a single byte is pulled (names, dtypes, shapes, offsets, sizes, version, protocol).

`validate` raises ManifestError naming the first problem; `match_destinations` raises ShapeMismatchError
when a subscriber's buffers do not fit the manifest exactly.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass

from .buffers import DTYPES, BufferView, nbytes_of
from .errors import ManifestError, ShapeMismatchError
from .protocol import PROTOCOL_VERSION, Manifest, TensorEntry


@dataclass(frozen=True, slots=True)
class Placement:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def layout(views: Mapping[str, BufferView], align: int = 256) -> tuple[list[Placement], int]:
    """Place each tensor at the next `align`-byte boundary, in the given order; returns the total size."""
    out: list[Placement] = []
    pos = 0
    for name, v in views.items():
        pos = (pos + align - 1) // align * align
        out.append(Placement(name, v.dtype, v.shape, pos, v.nbytes))
        pos += v.nbytes
    return out, pos


def validate(m: Manifest) -> None:
    """Reject a manifest that could make a pull read the wrong bytes or write out of bounds."""
    if m.protocol != PROTOCOL_VERSION:
        raise ManifestError(f"manifest protocol {m.protocol}, this gyre-xfer speaks {PROTOCOL_VERSION}")
    if m.version < 1:
        raise ManifestError(f"manifest version must be >= 1, got {m.version}")
    if not m.endpoint:
        raise ManifestError("manifest has no endpoint")
    if m.region.nbytes < 0:
        raise ManifestError(f"manifest region has negative size {m.region.nbytes}")
    seen: set[str] = set()
    spans: list[tuple[int, int, str]] = []
    for t in m.tensors:
        where = f"tensor {t.name!r} of version {m.version}"
        if not t.name:
            raise ManifestError(f"manifest version {m.version} has a tensor with an empty name")
        if t.name in seen:
            raise ManifestError(f"{where}: name appears twice")
        seen.add(t.name)
        if t.dtype not in DTYPES:
            raise ManifestError(f"{where}: unknown dtype {t.dtype!r}")
        if any(d < 0 for d in t.shape):
            raise ManifestError(f"{where}: negative dimension in shape {t.shape}")
        want = nbytes_of(t.dtype, t.shape)
        if t.nbytes != want:
            raise ManifestError(f"{where}: {t.nbytes} bytes, but {t.dtype}{list(t.shape)} needs {want}")
        if t.offset < 0 or t.offset + t.nbytes > m.region.nbytes:
            raise ManifestError(
                f"{where}: bytes [{t.offset}, {t.offset + t.nbytes}) lie outside the "
                f"{m.region.nbytes}-byte region"
            )
        if not -1 <= t.crc32 < 2**32:
            raise ManifestError(f"{where}: checksum {t.crc32} is not a crc32")
        spans.append((t.offset, t.offset + t.nbytes, t.name))
    spans.sort()
    for (_, end, a), (start, _, b) in itertools.pairwise(spans):
        if start < end:
            raise ManifestError(f"manifest version {m.version}: tensors {a!r} and {b!r} overlap")


def match_destinations(tensors: tuple[TensorEntry, ...], dests: Mapping[str, BufferView]) -> None:
    """Every manifest tensor needs a destination of the same dtype and shape, and nothing else."""
    names = {t.name for t in tensors}
    missing = sorted(names - dests.keys())
    extra = sorted(dests.keys() - names)
    if missing or extra:
        raise ShapeMismatchError(
            f"destination names differ from the manifest: missing {missing[:8]}, unexpected {extra[:8]}"
        )
    for t in tensors:
        d = dests[t.name]
        if d.shape != t.shape or d.dtype != t.dtype:
            raise ShapeMismatchError(
                f"{t.name!r}: manifest has {t.dtype}{list(t.shape)}, destination is {d.dtype}{list(d.shape)}"
            )
