"""Prefill forward passes: one context in chunks on top of a cached prefix, or several fresh prompts at
once in one left-padded pass (each with its own position ids, so each row's logits are its own).

Both return per-request KV (only the valid columns, views into the pass's cache) and the logits of the
last position of each request.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from gyre_engine.server.batch import RowKV, cache_from_layers, cache_layers


def prefill_one(
    model: Any, cache_kw: str, ctx: list[int], kv: RowKV | None, chunk: int, device: torch.device
) -> tuple[RowKV, torch.Tensor]:
    """KV of `ctx` and its last logits [1, V]; `kv` covers a cached prefix of `ctx` (or is None)."""
    start = kv.length if kv is not None else 0
    cache = cache_from_layers(kv.keys, kv.values) if kv is not None else DynamicCache()
    out = None
    for s in range(start, len(ctx), chunk):
        e = min(s + chunk, len(ctx))
        out = model(
            input_ids=torch.tensor([ctx[s:e]], device=device),
            position_ids=torch.arange(s, e, device=device)[None],
            use_cache=True,
            logits_to_keep=1,
            **{cache_kw: cache},
        )
    if out is None:
        raise ValueError("nothing to prefill: the whole context is cached")
    return RowKV(*cache_layers(cache)), out.logits[:, -1]


def prefill_group(
    model: Any, cache_kw: str, ctxs: list[list[int]], device: torch.device
) -> tuple[list[RowKV], torch.Tensor]:
    """KV of each fresh context and the last logits of each [G, V], from one left-padded pass."""
    width = max(len(c) for c in ctxs)
    ids = torch.zeros((len(ctxs), width), dtype=torch.long)
    mask = torch.zeros((len(ctxs), width), dtype=torch.long)
    pos = torch.zeros((len(ctxs), width), dtype=torch.long)
    for i, c in enumerate(ctxs):
        ids[i, width - len(c) :] = torch.tensor(c)
        mask[i, width - len(c) :] = 1
        pos[i, width - len(c) :] = torch.arange(len(c))
    cache = DynamicCache()
    out = model(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        position_ids=pos.to(device),
        use_cache=True,
        logits_to_keep=1,
        **{cache_kw: cache},
    )
    keys, values = cache_layers(cache)
    rows = [
        RowKV(
            [k[i : i + 1, :, width - len(c) :] for k in keys],
            [v[i : i + 1, :, width - len(c) :] for v in values],
        )
        for i, c in enumerate(ctxs)
    ]
    return rows, out.logits[:, -1]
