"""The digest of a parameter layout: (name, shape, dtype) of every parameter, in order. A trainer's
snapshots and an engine's pulls carry it, so weights are only ever read into the layout they were
written from (`model.Layout`, and a Megatron rank's whole-model layout in `mplayout`)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import torch


def layout_digest(params: Iterable[tuple[str, Sequence[int], torch.dtype]]) -> str:
    """The digest of (name, shape, dtype) of every parameter, in order: 16 hex digits of SHA-256."""
    h = hashlib.sha256()
    for name, shape, dtype in params:
        h.update(f"{name}:{tuple(shape)}:{dtype};".encode())
    return h.hexdigest()[:16]
