"""Prefill forward passes: one chunk of a context on top of its cache (long or prefix-cached prompts are
prefilled chunk by chunk, one chunk budget per engine step; its attention is `long_kv.chunk_attention`,
the bottom-right causal mask without building it), several fresh prompts at once in one left-padded
pass (each with its own position ids, so each row's logits are its own, with its own KV), or the rests of
several prefix-cached prompts at once in one packed pass (`prefill_packed`).

The packed pass is what an agent's calls need: each call extends a cached context by a few tokens to a
few thousand (a tool's output), and prefilled one call per forward pass the engine spent 80% of its busy
time in prefill at about 700 tokens/s on one H100 (tens of new tokens a call: integration's
`bench/h200_run.py` on `examples/h200-shared.toml`): each pass is the model's whole sequence of kernels
for a handful of tokens. Packed, the rows' new tokens run as one sequence through every projection, norm and MLP (each
token with its own position), and only attention is per row: each row's keys and values are appended to
its own cache and its queries attend over that, with the bottom-right causal mask, so a row's logits and
KV are those of its own pass.
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
from gyre_engine.server.long_kv import (
    CACHED_ATTN_NAME,
    attention_as,
    check_range,
    chunk_attention,
    chunk_forward,
)
from gyre_engine.server.slots import SlotCache

PACKED_ATTN_NAME = "gyre_packed_prefill"


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


def prefill_packed(
    model: Any, cache_kw: str, rows: list[tuple[list[int], int, DynamicCache]], device: torch.device
) -> torch.Tensor:
    """Run each row's `ctx[start:]` on top of its `cache` (which covers `ctx[:start]`, start >= 1, and
    grows to the whole context) in one packed pass; returns the logits of each row's last position [G, V].
    (see the module docstring)"""
    ids: list[int] = []
    pos: list[int] = []
    offsets = [0]
    for ctx, start, _ in rows:
        check_range(ctx, start, len(ctx))
        if start < 1:
            raise ValueError("a packed row needs a cached prefix (start >= 1)")
        ids.extend(ctx[start:])
        pos.extend(range(start, len(ctx)))
        offsets.append(len(ids))
    with attention_as(model, PACKED_ATTN_NAME, _packed_attention):
        out = model(
            input_ids=torch.tensor([ids], device=device),
            position_ids=torch.tensor([pos], device=device),
            attention_mask=torch.ones((1, 1, 1, 1), device=device),  # handed through untouched; unused
            use_cache=True,
            logits_to_keep=torch.tensor([o - 1 for o in offsets[1:]], device=device),
            gyre_caches=[cache for _, _, cache in rows],
            gyre_offsets=offsets,
            **{cache_kw: SlotCache()},  # hands each layer's packed keys and values to the attention
        )
    return out.logits[0]


def _packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function of `prefill_packed`: `query` [1, H, T, D], `key` and `value`
    [1, KVH, T, D] hold the packed rows' new tokens (row i at [offsets[i], offsets[i + 1]), after RoPE and
    norms); each row's part is appended to its own cache (`gyre_caches[i]`) and attends over that cache
    with the bottom-right causal mask. The mask transformers hands in is a placeholder (ignored).
    Returns [1, T, H, D]."""
    caches, offsets = kwargs["gyre_caches"], kwargs["gyre_offsets"]
    layer = module.layer_idx
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    outs = []
    for i, cache in enumerate(caches):
        a, b = offsets[i], offsets[i + 1]
        k, v = cache.update(key[:, :, a:b], value[:, :, a:b], layer)
        outs.append(chunk_attention(query[:, :, a:b].contiguous(), k, v, scale))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


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
