"""Export and import of a cached prefix as plain bytes plus the token ids they cover (`KvPrefix`).

A draining engine exports the KV of an agent's context; another engine of the same model imports it into
its prefix cache and continues without re-prefill. The record is transport-neutral (msgpack, raw array
bytes): today it moves in-process or over HTTP (/export_prefix, /import_prefix); gyre-xfer will carry the
same arrays. Both functions run on the engine thread (through `Engine.call`).
"""

from __future__ import annotations

import hashlib
import json

import torch

from gyre_engine.protocol import PROTOCOL_VERSION, KvPrefix
from gyre_engine.server.batch import RowKV
from gyre_engine.server.engine import Engine


class KvTransferError(ValueError):
    """A KvPrefix that does not fit this engine (other model, shapes, dtype or weight version)."""


def model_fingerprint(engine: Engine) -> str:
    """Hash of what decides the KV layout: architecture dimensions and KV dtype."""
    c = engine.model.config.get_text_config()
    keys = ("model_type", "num_hidden_layers", "num_key_value_heads", "head_dim", "hidden_size", "vocab_size")
    desc = {k: getattr(c, k, None) for k in keys}
    desc["dtype"] = str(next(engine.model.parameters()).dtype)
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]


def _to_bytes(t: torch.Tensor) -> bytes:
    return t.detach().squeeze(0).contiguous().cpu().view(torch.uint8).numpy().tobytes()


def _from_bytes(
    b: bytes, dtype: torch.dtype, shape: tuple[int, int, int], device: torch.device
) -> torch.Tensor:
    t = torch.frombuffer(bytearray(b), dtype=torch.uint8).view(dtype).reshape(shape)
    return t.unsqueeze(0).to(device)


def export_prefix(engine: Engine, token_ids: list[int]) -> KvPrefix | None:
    """The KV of the longest cached prefix of `token_ids`, or None when nothing is cached."""
    engine.check_token_ids(token_ids)
    hit = engine.prefix.lookup(token_ids, limit=len(token_ids))
    if hit.kv is None:
        return None
    kv = hit.kv
    dtype = str(kv.keys[0].dtype).removeprefix("torch.")
    _, heads, n, dim = kv.keys[0].shape
    return KvPrefix(
        version=PROTOCOL_VERSION,
        model_fingerprint=model_fingerprint(engine),
        weight_version=engine.weight_version,
        token_ids=list(token_ids[: hit.length]),
        dtype=dtype,
        shape=(int(heads), int(n), int(dim)),
        keys=[_to_bytes(k) for k in kv.keys],
        values=[_to_bytes(v) for v in kv.values],
    )


def import_prefix(engine: Engine, rec: KvPrefix) -> int:
    """Put an exported prefix into this engine's prefix cache; returns the tokens it covers."""
    if rec.version != PROTOCOL_VERSION:
        raise KvTransferError(
            f"KvPrefix protocol version {rec.version}, this engine speaks {PROTOCOL_VERSION}"
        )
    if rec.model_fingerprint != model_fingerprint(engine):
        raise KvTransferError("KvPrefix comes from a model of another shape or dtype")
    if rec.weight_version != engine.weight_version:
        raise KvTransferError(
            f"KvPrefix was computed with weight_version {rec.weight_version}, this engine has {engine.weight_version}"
        )
    layers = engine.model.config.get_text_config().num_hidden_layers
    if len(rec.keys) != layers or len(rec.values) != layers:
        raise KvTransferError(f"KvPrefix has {len(rec.keys)} layers, the model {layers}")
    if rec.shape[1] != len(rec.token_ids) or not rec.token_ids:
        raise KvTransferError(
            f"KvPrefix covers {rec.shape[1]} positions but carries {len(rec.token_ids)} token ids"
        )
    dtype = getattr(torch, rec.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise KvTransferError(f"unknown dtype {rec.dtype!r}")
    nbytes = rec.shape[0] * rec.shape[1] * rec.shape[2] * dtype.itemsize
    if any(len(b) != nbytes for b in (*rec.keys, *rec.values)):
        raise KvTransferError(f"each KV block must be {nbytes} bytes for shape {list(rec.shape)} {rec.dtype}")
    if any(not 0 <= t < engine.vocab_size for t in rec.token_ids):
        raise KvTransferError("KvPrefix token ids fall outside the vocabulary")
    kv = RowKV(
        [_from_bytes(b, dtype, rec.shape, engine.device) for b in rec.keys],
        [_from_bytes(b, dtype, rec.shape, engine.device) for b in rec.values],
    )
    engine.prefix.insert(list(rec.token_ids), kv)
    return len(rec.token_ids)


def cached_prefix(engine: Engine, token_ids: list[int]) -> tuple[list[int], RowKV, str, str] | None:
    """(covered token ids, their KV, model fingerprint, weight version) of the longest cached prefix of
    `token_ids`, or None. The KV tensors are never written in place, so they may be read off-thread."""
    engine.check_token_ids(token_ids)
    hit = engine.prefix.lookup(token_ids, limit=len(token_ids))
    if hit.kv is None:
        return None
    return list(token_ids[: hit.length]), hit.kv, model_fingerprint(engine), engine.weight_version


def install_prefix(engine: Engine, token_ids: list[int], kv: RowKV, weight_version: str) -> int:
    """Put KV pulled from another engine into the prefix cache, unless the weights changed meanwhile."""
    if weight_version != engine.weight_version:
        raise KvTransferError(
            f"the prefix was computed with weight_version {weight_version}, this engine now has "
            f"{engine.weight_version}; nothing was installed"
        )
    if len(token_ids) > engine.prefix.max_tokens:
        raise KvTransferError(
            f"the prefix ({len(token_ids)} tokens) exceeds this engine's prefix cache budget "
            f"({engine.prefix.max_tokens} tokens, --max-cached-tokens); nothing was installed"
        )
    engine.prefix.insert(list(token_ids), kv)
    return len(token_ids)


def check_offer_fits(engine: Engine, fingerprint: str, weight_version: str, token_ids: list[int]) -> int:
    """Raise KvTransferError unless a prefix of that model, version and ids fits; returns the layers."""
    if fingerprint != model_fingerprint(engine):
        raise KvTransferError("the offered prefix comes from a model of another shape or dtype")
    if weight_version != engine.weight_version:
        raise KvTransferError(
            f"the offered prefix was computed with weight_version {weight_version}, this engine has {engine.weight_version}"
        )
    if not token_ids or any(not 0 <= t < engine.vocab_size for t in token_ids):
        raise KvTransferError("the offered token ids are empty or fall outside the vocabulary")
    return int(engine.model.config.get_text_config().num_hidden_layers)
