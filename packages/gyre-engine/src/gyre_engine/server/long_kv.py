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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from gyre_engine.server.batch import RowKV
from gyre_engine.server.slots import SlotCache

log = logging.getLogger(__name__)
ATTN_NAME = "gyre_long_prefill"
CACHED_ATTN_NAME = "gyre_cached_prefill"
_registered = False


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor]]
"""attend(q, k, v, causal) -> (output [1, H, n, D], log-sum-exp of each query's scores [1, H, n], float32)."""

_split_ok: dict[tuple[Any, ...], bool] = {}
"""Per device, dtype and head shape: whether the split flash path agreed with the repeat path once."""


def chunk_attention_path(q: torch.Tensor, k: torch.Tensor) -> str:
    """Which kernel `chunk_attention` runs for these shapes: "flash" (CUDA, grouped KV heads as they are,
    flash's causal mask aligned to the bottom right), "flash-split" (CUDA, where flash takes no causal
    mask between a chunk and a longer prefix: flash over the prefix without a mask and over the chunk's
    own columns with the square causal one, the two merged by their log-sum-exps), "repeat" (CUDA: KV
    heads repeated per query head, torch's lower-right causal kernels) or "masked" (elsewhere: the mask
    is built)."""
    if q.device.type != "cuda":
        return "masked"
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    if q.shape[-1] % 8:
        return "repeat"
    with warnings.catch_warnings():  # the check warns why a kernel cannot run; the fallback handles it
        warnings.simplefilter("ignore")
        gqa = k.shape[1] != q.shape[1]
        if can_use_flash_attention(SDPAParams(q, k, k, None, 0.0, True, gqa)):
            return "flash"
        square = k[:, :, -q.shape[2] :]
        split = can_use_flash_attention(
            SDPAParams(q, k, k, None, 0.0, False, gqa)
        ) and can_use_flash_attention(SDPAParams(q, square, square, None, 0.0, True, gqa))
    return "flash-split" if split and _split_checked(q, k) else "repeat"


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend: Attend) -> torch.Tensor:
    """`chunk_attention` from two unmasked-or-square attentions: the chunk's n queries over the prefix's
    columns [0, L - n) with no mask, and over their own last n columns with the square causal mask
    (which aligns top left and bottom right alike), merged by their log-sum-exps: each part's output
    weighted by the share of the softmax its scores hold."""
    n, width = q.shape[2], k.shape[2]
    own, lse_own = attend(q, k[:, :, width - n :], v[:, :, width - n :], True)
    if width == n:
        return own
    pre, lse_pre = attend(q, k[:, :, : width - n], v[:, :, : width - n], False)
    lse = torch.logaddexp(lse_pre, lse_own)
    w_pre = torch.exp(lse_pre - lse).unsqueeze(-1)
    w_own = torch.exp(lse_own - lse).unsqueeze(-1)
    return (pre.float() * w_pre + own.float() * w_own).to(q.dtype)


def _flash(scale: float) -> Attend:
    def attend(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, is_causal=causal, return_debug_mask=False, scale=scale
        )
        return out[0], out[1][..., : q.shape[2]]  # (log-sum-exps [1, H, n] in float32)

    return attend


def _split_checked(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the split flash path agrees with the repeat path on this device, dtype and head shape
    (checked once, on random inputs: 64 queries over 320 columns; agreeing is an error under 0.05, what
    bf16 rounding leaves). A path that fails or disagrees is not used again in this process."""
    key = (q.device, q.dtype, q.shape[1], k.shape[1], q.shape[-1])
    ok = _split_ok.get(key)
    if ok is None:
        gen = torch.Generator(device=q.device).manual_seed(0)
        h, kvh, d = q.shape[1], k.shape[1], q.shape[-1]
        tq = torch.randn((1, h, 64, d), generator=gen, device=q.device).to(q.dtype)
        tk, tv = (torch.randn((1, kvh, 320, d), generator=gen, device=q.device).to(q.dtype) for _ in range(2))
        try:
            got = split_attention(tq, tk, tv, _flash(d**-0.5)).float()
            ref = _repeat_attention(tq, tk, tv, d**-0.5).float()
            err = float((got - ref).abs().max())
            ok = err < 0.05
            if not ok:
                log.warning("the split flash attention differs from the repeat path by %.3g: not used", err)
        except RuntimeError:
            log.warning("the split flash attention failed; repeating KV heads instead", exc_info=True)
            ok = False
        _split_ok[key] = ok
    return ok


def _repeat_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    from torch.nn.attention.bias import causal_lower_right

    if k.shape[1] != q.shape[1]:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]), scale=scale
    )


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a chunk's queries [1, H, n, D] over keys/values [1, KVH, L, D] whose last n
    columns are the chunk's own (query i sits at column L - n + i): the bottom-right-aligned causal mask.
    On CUDA no [n, L] mask is built: flash attention (whose causal mask is aligned to the bottom right)
    over the grouped KV heads as they are (whole, or split at the chunk's own columns: `split_attention`),
    else torch's lower-right causal bias over KV heads repeated per query head."""
    path = chunk_attention_path(q, k)
    if path == "flash-split":
        try:
            return split_attention(q, k, v, _flash(scale))
        except RuntimeError:  # (as below)
            log.warning(
                "the split flash attention refused a chunk; repeating KV heads instead", exc_info=True
            )
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
    return _repeat_attention(q, k, v, scale)


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
    keys, values = buf[0, layer, :, :, :end], buf[1, layer, :, :, :end]
    return _cached_prefill_attention(module, query, keys, values, attention_mask, scaling)


def _cached_prefill_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function for a chunk prefilled on top of a cache (`prefill.prefill_chunk`:
    one row, no padding): `key` and `value` are the cache's, the prefix and the chunk, so the mask is
    the bottom-right causal one `chunk_attention` applies; the mask transformers hands in is a
    placeholder (ignored). Returns [1, n, H, D]."""
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    return chunk_attention(query, key, value, scale).transpose(1, 2).contiguous(), None


def register_attention() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_NAME, _prefill_attention)
        AttentionInterface.register(CACHED_ATTN_NAME, _cached_prefill_attention)
        _registered = True


@contextmanager
def attention_as(model: Any, name: str, fn: Callable[..., Any] | None = None) -> Iterator[None]:
    """The model's attention is the registered function `name` inside this block (`fn` registered under
    that name first, when given; the engine's thread is the only one that runs the model)."""
    register_attention()
    if fn is not None:
        from transformers import AttentionInterface

        AttentionInterface.register(name, fn)
    cfg = model.config
    old = cfg._attn_implementation
    cfg._attn_implementation = name
    try:
        yield
    finally:
        cfg._attn_implementation = old


def check_range(ctx: list[int], start: int, end: int) -> None:
    """ValueError unless [start, end) is a non-empty range of `ctx`."""
    if not 0 <= start < end <= len(ctx):
        raise ValueError(f"bad prefill range [{start}, {end}) of a {len(ctx)}-token context")


def chunk_forward(
    model: Any,
    cache_kw: str,
    ctx: list[int],
    start: int,
    end: int,
    device: torch.device,
    cache: Any,
    attention: str,
    **extra: Any,
) -> torch.Tensor:
    """`ctx[start:end]` through the model at positions [start, end) on top of `cache` (which holds
    `ctx[:start]`), its attention the registered function `attention` (which ignores the mask: a
    placeholder is handed through, so that transformers builds none); `extra` goes to the attention
    function as keyword arguments. Returns the logits of position `end - 1` [1, V]."""
    with attention_as(model, attention):
        out = model(
            input_ids=torch.tensor([ctx[start:end]], device=device),
            position_ids=torch.arange(start, end, device=device)[None],
            attention_mask=torch.ones((1, 1, 1, 1), device=device),  # handed through untouched; unused
            use_cache=True,
            logits_to_keep=1,
            **extra,
            **{cache_kw: cache},
        )
    return out.logits[:, -1]


@torch.inference_mode()
def prefill_into(
    model: Any, cache_kw: str, ctx: list[int], buf: torch.Tensor, start: int, end: int
) -> torch.Tensor:
    """Run `ctx[start:end]` over a one-row buffer (a long slot's view) that holds `ctx[:start]`, writing
    its KV at columns [start, end); returns the logits of position `end - 1` [1, V]."""
    check_range(ctx, start, end)
    if end > buf.shape[-2]:
        raise ValueError(f"a long slot holds {buf.shape[-2]} tokens; the prefill reaches {end}")
    return chunk_forward(
        model, cache_kw, ctx, start, end, buf.device, SlotCache(), ATTN_NAME, gyre_kv=buf, gyre_start=start
    )


def copy_prefix(buf: torch.Tensor, kv: RowKV) -> None:
    """Write a cached prefix held elsewhere into the first columns of a one-row buffer (a long slot's view)."""
    n = kv.length
    with torch.inference_mode():
        for i, (k, v) in enumerate(zip(kv.keys, kv.values, strict=True)):
            buf[0, i, :, :, :n].copy_(k)
            buf[1, i, :, :, :n].copy_(v)
