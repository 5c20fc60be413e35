"""Prefill forward passes: one chunk of a context on top of its cache (long or prefix-cached prompts are
prefilled chunk by chunk, one chunk budget per engine step; its attention is `long_kv.chunk_attention`,
the bottom-right causal mask without building it), or several fresh prompts at once in one left-padded
pass (each with its own position ids, so each row's logits are its own, with its own KV).
On CUDA the engine can run the left-padded pass through torch.compile (`Engine.Config.compile_prefill`,
off by default: the compilation takes minutes): eagerly, a prefill of 64 prompts of 128 tokens spends
more time in unfused elementwise kernels (norms, rotary, residual adds, the cache's concatenations) than
in its GEMMs (`bench/profile_b64.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import DynamicCache

from gyre_engine.server.batch import RowKV, cache_from_layers, cache_layers
from gyre_engine.server.long_kv import CACHED_ATTN_NAME, check_range, chunk_forward


def start_cache(kv: RowKV | None) -> DynamicCache:
    """A fresh cache, holding a copy of `kv` (a cached prefix) when given."""
    return cache_from_layers(kv.keys, kv.values) if kv is not None else DynamicCache()


def prefill_chunk(
    model: Any, cache_kw: str, ctx: list[int], cache: DynamicCache, start: int, end: int, device: torch.device
) -> torch.Tensor:
    """Run `ctx[start:end]` on top of `cache` (which covers `ctx[:start]` and grows to `end`); returns the
    logits of position `end - 1` [1, V]."""
    check_range(ctx, start, end)
    # (flash over the prefix and the chunk on CUDA, no mask built)
    return chunk_forward(model, cache_kw, ctx, start, end, device, cache, CACHED_ATTN_NAME)


def group_forward(
    model: Any, cache_kw: str, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """One padded prefill pass from an empty cache: the last position's logits [G, V] and the cache's
    per-layer keys and values (what `prefill_group` runs, eagerly or through torch.compile)."""
    cache = DynamicCache()
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=pos,
        use_cache=True,
        logits_to_keep=1,
        **{cache_kw: cache},
    )
    keys, values = cache_layers(cache)
    return out.logits[:, -1], keys, values


def prefill_group(
    model: Any,
    cache_kw: str,
    ctxs: list[list[int]],
    device: torch.device,
    forward: Callable[..., tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]] | None = None,
) -> tuple[list[RowKV], torch.Tensor]:
    """KV of each fresh context and the last logits of each [G, V], from one left-padded pass (through
    `forward`, a compiled `group_forward`, when given)."""
    width = max(len(c) for c in ctxs)
    ids = torch.zeros((len(ctxs), width), dtype=torch.long)
    mask = torch.zeros((len(ctxs), width), dtype=torch.long)
    pos = torch.zeros((len(ctxs), width), dtype=torch.long)
    for i, c in enumerate(ctxs):
        ids[i, width - len(c) :] = torch.tensor(c)
        mask[i, width - len(c) :] = 1
        pos[i, width - len(c) :] = torch.arange(len(c))
    logits, keys, values = (forward or group_forward)(
        model, cache_kw, ids.to(device), mask.to(device), pos.to(device)
    )
    rows = [
        RowKV(
            [k[i : i + 1, :, width - len(c) :] for k in keys],
            [v[i : i + 1, :, width - len(c) :] for v in values],
        )
        for i, c in enumerate(ctxs)
    ]
    return rows, logits
