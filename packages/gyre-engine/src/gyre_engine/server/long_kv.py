"""Long contexts: rows of one KV buffer, each prefilled in place, chunk by chunk.

A request whose context plus its new tokens does not fit a decode slot (`Engine.Config.slot_max_len`) is
served from a long slot: a row of the long slots' `SlotBatch` (`dedicated`), whose buffer (`[2, layers,
long_context_slots, kv_heads, capacity, head_dim]`, `Engine.Config.long_context_tokens` columns) is
allocated once, at the first long request. Its prefill writes each chunk's keys and values straight into
its slot (a one-row view of the buffer, `SlotBatch.row_buffer`) and attends to the cached prefix there
(`prefill_into`: causal attention aligned to the bottom right, `chunk_attention`: flash attention over
grouped KV heads on CUDA), so prefill activations are one chunk's and the context is never concatenated
or copied; it then decodes there, all running long rows in one step of the slots' CUDA graphs and Triton
decode kernel (a slot being prefilled, free, or held by the prefix cache is a hole that the step neither
reads nor writes). When it finishes, the prefix cache keeps views of its slot (`LongRowKV`), and the next
call that extends the context takes the slot over: an agent's context is carried from call to call
without a copy.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
import torch.nn.functional as F

from gyre_engine.server.batch import RowKV
from gyre_engine.server.slots import SlotCache

log = logging.getLogger(__name__)
ATTN_NAME = "gyre_long_prefill"
_registered = False


def chunk_attention_path(q: torch.Tensor, k: torch.Tensor) -> str:
    """Which kernel `chunk_attention` runs for these shapes: "flash" (CUDA, grouped KV heads as they are),
    "repeat" (CUDA: KV heads repeated per query head, torch's lower-right causal kernels) or "masked"
    (elsewhere: the mask is built)."""
    if q.device.type != "cuda":
        return "masked"
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    with warnings.catch_warnings():  # the check warns why a kernel cannot run; the fallback handles it
        warnings.simplefilter("ignore")
        gqa = k.shape[1] != q.shape[1]
        ok = can_use_flash_attention(SDPAParams(q, k, k, None, 0.0, True, gqa))
    return "flash" if ok and q.shape[-1] % 8 == 0 else "repeat"


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a chunk's queries [1, H, n, D] over keys/values [1, KVH, L, D] whose last n
    columns are the chunk's own (query i sits at column L - n + i): the bottom-right-aligned causal mask.
    On CUDA no [n, L] mask is built: flash attention (whose causal mask is aligned to the bottom right)
    over the grouped KV heads as they are, else torch's lower-right causal bias over KV heads repeated
    per query head."""
    from torch.nn.attention.bias import causal_lower_right

    n, width = q.shape[2], k.shape[2]
    path = chunk_attention_path(q, k)
    if path == "flash":
        try:
            out = torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, is_causal=True, return_debug_mask=False, scale=scale
            )
            return out[0]
        except RuntimeError:  # a build whose flash kernel refuses these inputs: the path below
            log.warning(
                "flash attention refused a long-prefill chunk; repeating KV heads instead", exc_info=True
            )
    if k.shape[1] != q.shape[1]:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(n, width), scale=scale)


def _prefill_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function for a chunk of a long prefill: writes the chunk's key/value
    ([1, KVH, n, D], after RoPE and norms) at columns [start, start + n) of the buffer (the model call's
    keyword arguments `gyre_kv` and `gyre_start`), then attends over columns [0, start + n). The mask
    transformers hands in is a placeholder (ignored). Returns [1, n, H, D]."""
    buf, start = kwargs["gyre_kv"], int(kwargs["gyre_start"])
    layer = module.layer_idx
    assert isinstance(layer, int)
    end = start + query.shape[2]
    buf[0, layer, :, :, start:end].copy_(key)
    buf[1, layer, :, :, start:end].copy_(value)
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    out = chunk_attention(query, buf[0, layer, :, :, :end], buf[1, layer, :, :, :end], scale)
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_NAME, _prefill_attention)
        _registered = True


@torch.inference_mode()
def prefill_into(
    model: Any, cache_kw: str, ctx: list[int], buf: torch.Tensor, start: int, end: int
) -> torch.Tensor:
    """Run `ctx[start:end]` over a one-row buffer (a long slot's view) that holds `ctx[:start]`, writing
    its KV at columns [start, end); returns the logits of position `end - 1` [1, V]."""
    if not 0 <= start < end <= len(ctx):
        raise ValueError(f"bad prefill range [{start}, {end}) of a {len(ctx)}-token context")
    if end > buf.shape[-2]:
        raise ValueError(f"a long slot holds {buf.shape[-2]} tokens; the prefill reaches {end}")
    register_attention()
    dev = buf.device
    cfg = model.config
    old = cfg._attn_implementation
    cfg._attn_implementation = ATTN_NAME
    try:
        out = model(
            input_ids=torch.tensor([ctx[start:end]], device=dev),
            position_ids=torch.arange(start, end, device=dev)[None],
            attention_mask=torch.ones((1, 1, 1, 1), device=dev),  # handed through untouched; unused
            use_cache=True,
            logits_to_keep=1,
            gyre_kv=buf,
            gyre_start=start,
            **{cache_kw: SlotCache()},
        )
    finally:
        cfg._attn_implementation = old
    return out.logits[:, -1]


def copy_prefix(buf: torch.Tensor, kv: RowKV) -> None:
    """Write a cached prefix held elsewhere into the first columns of a one-row buffer (a long slot's view)."""
    n = kv.length
    with torch.inference_mode():
        for i, (k, v) in enumerate(zip(kv.keys, kv.values, strict=True)):
            buf[0, i, :, :, :n].copy_(k)
            buf[1, i, :, :, :n].copy_(v)
