"""Prefix offers over CUDA IPC as an engine on a GPU sends them, for tests that run where no GPU is: the
description `cuda_ipc.share` makes of a flat uint8 device buffer (torch's handles as bytes, its
reference-counter file name), in an offer shaped as `XferHub.offer_on_device` shapes it."""

from __future__ import annotations

import os
import uuid

import msgspec
from gyre_engine.protocol import CudaIpcTensor, PrefixOffer
from gyre_engine.server.xfer import STAMP_BYTES

COUNTER_FILE = "/torch_4242_3979417632_0"
"""A reference-counter file name as torch makes them (`at::NewProcessWideShmHandle`: pid, random, count)."""


def described(nbytes: int, **change: object) -> CudaIpcTensor:
    """What `cuda_ipc.share` sends for a flat uint8 buffer of `nbytes` at the start of its allocation."""
    fields: dict[str, object] = {
        "device_uuid": str(uuid.uuid4()),
        "size": [nbytes],
        "stride": [1],
        "tensor_offset": 0,
        "dtype": "uint8",
        "storage_handle": b"\x02\x00" + os.urandom(64),  # version, kind, cudaIpcMemHandle_t
        "storage_size_bytes": nbytes,
        "storage_offset_bytes": 0,
        "ref_counter_handle": COUNTER_FILE,
        "ref_counter_offset": 7,
        "event_handle": os.urandom(64),
        "event_sync_required": True,
    }
    fields.update(change)
    return CudaIpcTensor(**fields)  # type: ignore[arg-type]


def offer_of(
    shared: CudaIpcTensor, tokens: int, heads: int, dim: int, dtype: str = "bfloat16"
) -> PrefixOffer:
    """A device offer of `tokens` token ids (fingerprint "fp", weight version "0")."""
    return PrefixOffer(
        offer_id=uuid.uuid4().hex,
        model_fingerprint="fp",
        weight_version="0",
        token_ids=list(range(100, 100 + tokens)),
        dtype=dtype,
        kv_heads=heads,
        head_dim=dim,
        block_tokens=8,
        lease_s=120.0,
        kv_offer=msgspec.Raw(b"null"),
        cuda_ipc=shared,
    )


def on_device(like: PrefixOffer, layers: int, itemsize: int) -> PrefixOffer:
    """The device offer an engine on a GPU would have made of the same prefix as `like` (an offer over
    shared memory from an engine of the same model)."""
    plane = like.kv_heads * len(like.token_ids) * like.head_dim * itemsize
    return msgspec.structs.replace(
        like,
        offer_id=uuid.uuid4().hex,
        kv_offer=msgspec.Raw(b"null"),
        cuda_ipc=described(2 * layers * plane + STAMP_BYTES),
    )
