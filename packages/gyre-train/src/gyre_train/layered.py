"""Training one execution tree whose shared prefix is too long for `chunked.py`'s kept state, layer by layer.

`chunked.py` runs the chunks through all layers at once, so it keeps every layer's keys/values of the
shared prefix and their float32 gradients (336 KiB per token on the Qwen3-0.6B shape). This module runs
the same chunks (same plan, masks, kept-buffer joins) layer-major instead, as per-layer activation
checkpointing over the whole tree: pass 1 forwards every chunk through layer 0, then layer 1, ..., keeping
only each layer's input hidden states (`LayerStore`, on the device or in page-locked host memory) and one
layer's shared keys/values; the loss is taken per chunk at the top, leaving the gradient of the last
layer's output. Pass 2 goes down the layers: it recomputes that layer's shared keys/values from its kept
input (projections only), then runs the chunks in reverse with autograd through that one layer, exactly
as `chunked.py` does through the whole model, turning the gradient of the layer's output into that of its
input. Kept state per token is one hidden state per layer in model dtype (56 KiB on the 0.6B shape), plus
one layer's keys/values and their float32 gradients; each token is forwarded twice and backward once, as
in `chunked.py`. The gradient equals the whole tree as one micro-batch (tested on the CPU).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch
from gyre_base.meminfo import available_bytes
from gyre_traj.loss import LossConfig, TorchBatch
from gyre_traj.pack import PackedBatch

from gyre_train.architecture import ChunkMemory, Kernel
from gyre_train.chunked import (
    Chunk,
    ChunkCache,
    Kept,
    check_kernel,
    chunk_mask,
    head_dim,
    kept_bytes,
    model_inputs,
    plan,
    sliced_loss_backward,
    tree_metrics,
)
from gyre_train.layerstore import LayerStore

MEMORY_MARGIN = 0.85
"""`auto` counts a method as fitting when its kept state is below this share of the free memory (the rest
is one chunk's activations, the loss slices and the allocator's slack)."""


class TreeMemoryError(MemoryError):
    """No memory method fits: the message names the bytes each needs and what is free."""


def layered_bytes(b: PackedBatch, budget: int, model: Any, host: bool) -> dict[str, int]:
    """What `layered_loss_backward` keeps beyond one chunk's activations, in bytes: the layer inputs (on the
    host with `host`), and on the device the hidden states in flight (two of model dtype, one float32
    gradient) and one layer's shared keys/values and their float32 gradients."""
    cfg = model.config
    t = b.num_tokens
    item = next(model.parameters()).element_size()
    layers, hidden = cfg.num_hidden_layers, cfg.hidden_size
    shared = max((c.hi for c in plan(b, budget) if c.needed), default=0)
    per = cfg.num_key_value_heads * head_dim(cfg) * 2
    inputs = layers * t * hidden * item
    work = 3 * t * hidden * item + t * hidden * 4 + per * ((shared + budget) * item + shared * 4)
    return {
        "host_bytes": inputs if host else 0,
        "device_bytes": work + (2 * t * hidden * item if host else inputs),
    }


def choose(b: PackedBatch, budget: int, model: Any, memory: ChunkMemory) -> ChunkMemory:
    """The method `memory` names, or for `auto` the first that fits the device's (and host's) free memory;
    `TreeMemoryError` naming each one's bytes when none does (or the one asked for does not). On the CPU,
    `auto` is "kept" and nothing is checked."""
    dev = next(model.parameters()).device
    if dev.type != "cuda":
        return "kept" if memory == "auto" else memory
    # free = the driver's free memory + what this process's allocator holds but no tensor uses
    free_dev = (
        int(torch.cuda.mem_get_info(dev)[0])
        + torch.cuda.memory_reserved(dev)
        - torch.cuda.memory_allocated(dev)
    )
    k = kept_bytes(b, budget, model)
    lay, host = layered_bytes(b, budget, model, False), layered_bytes(b, budget, model, True)
    need: dict[ChunkMemory, tuple[int, int]] = {
        "kept": (k["kv_bytes"] + k["accumulator_bytes"], 0),
        "layers": (lay["device_bytes"], 0),
        "layers-host": (host["device_bytes"], host["host_bytes"]),
    }
    return pick_method(
        need, memory, free_dev, available_bytes(), f"tree of {b.num_tokens} tokens (chunk budget {budget})"
    )


def pick_method(
    need: dict[ChunkMemory, tuple[int, int]], memory: ChunkMemory, free_dev: int, free_host: int, what: str
) -> ChunkMemory:
    """From each method's (device, host) bytes `need`: `memory` if it fits `MEMORY_MARGIN` of what is free,
    or for "auto" the first that does (in `need`'s order); else `TreeMemoryError` naming them all."""
    fits = {m: d <= MEMORY_MARGIN * free_dev and h <= MEMORY_MARGIN * free_host for m, (d, h) in need.items()}
    if memory == "auto":
        pick = next((m for m in need if fits[m]), None)
    else:
        if memory not in need:
            raise ValueError(f"chunk_memory {memory!r}: use auto, {', '.join(need)}")
        pick = memory if fits[memory] else None
    if pick is None:
        said = ", ".join(
            f"{m}: {d / 2**30:.1f} GiB device + {h / 2**30:.1f} GiB host" for m, (d, h) in need.items()
        )
        raise TreeMemoryError(
            f"{what} does not fit with chunk_memory={memory!r}: kept state needs {said}; "
            f"free: {free_dev / 2**30:.1f} GiB device, {free_host / 2**30:.1f} GiB host"
        )
    return pick


class _OneLayer:
    """The cache a decoder layer sees: `ChunkCache` over one layer's kept buffers (layer index 0)."""

    def __init__(self, inner: ChunkCache) -> None:
        self.inner = inner

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *a: Any, **kw: Any) -> Any:
        return self.inner.update(k, v, 0)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


class _Captured(Exception):
    pass


class _Capture:
    """A cache that stores the chunk's keys/values in the kept buffers and stops the layer there (the
    attention and MLP after it are not needed to recompute the keys/values)."""

    def __init__(self, kept: Kept, c: Chunk) -> None:
        self.kept, self.c = kept, c

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *a: Any, **kw: Any) -> Any:
        kb, vb = self.kept.buffers(0, k)
        kb[:, :, self.c.lo : self.c.hi] = k
        vb[:, :, self.c.lo : self.c.hi] = v
        raise _Captured

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


class _Layers:
    """The model's pieces as layer-major training calls them: embedding, decoder layers, final norm, head,
    rotary embedding; the per-chunk masks and position embeddings are built once and reused by every layer."""

    def __init__(self, model: Any, tb: TorchBatch, chunks: list[Chunk], attention: Kernel) -> None:
        check_kernel(model, attention)
        backbone = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
        self.embed, self.norm = backbone.embed_tokens, backbone.norm
        self.layers = list(backbone.layers[: model.config.num_hidden_layers])
        self.head = model.get_output_embeddings()
        params = inspect.signature(type(self.layers[0]).forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        dev = tb.input_ids.device
        self.masks = []
        self.rope = []
        probe = self.embed.weight[:1]
        for c in chunks:
            kidx = torch.cat(
                [torch.as_tensor(c.ext, device=dev, dtype=torch.long), torch.arange(c.lo, c.hi, device=dev)]
            )
            self.masks.append(chunk_mask(tb, c, kidx, attention, probe.dtype))
            self.rope.append(backbone.rotary_emb(probe[None], tb.position_ids[c.lo : c.hi][None]))

    def run(self, layer: int, i: int, x: torch.Tensor, cache: Any) -> torch.Tensor:
        out = self.layers[layer](
            x[None],
            position_embeddings=self.rope[i],
            **model_inputs(self.masks[i]),
            use_cache=True,
            **{self.cache_arg: cache},
        )
        return (out[0] if isinstance(out, tuple) else out)[0]


def layered_loss_backward(
    model: Any,
    b: PackedBatch,
    budget: int,
    loss_cfg: LossConfig,
    attention: Kernel = "dense",
    loss_slice: int = 2048,
    host: bool = False,
    store: LayerStore | None = None,
) -> dict[str, float]:
    """Accumulate into `.grad` the gradient of the policy loss of tree `b`, layer by layer (see module);
    with `host`, the layer inputs are kept in host memory. `store`: a `LayerStore` of this tree's shape
    to reuse (page-locking tens of GiB takes seconds), else one is made."""
    chunks = plan(b, budget)
    dev = next(model.parameters()).device
    tb = TorchBatch.from_packed(b, device=dev)
    net = _Layers(model, tb, chunks, attention)
    n_layers, t = len(net.layers), b.num_tokens
    dtype = net.embed.weight.dtype
    if store is None:
        store = LayerStore(n_layers, t, model.config.hidden_size, dtype, dev, host)
    elif (store.layers, store.tokens, store.hidden, store.host) != (
        n_layers,
        t,
        model.config.hidden_size,
        host,
    ):
        raise ValueError(
            f"store of {store.layers} layers x {store.tokens} tokens (host={store.host}) does not fit"
        )
    store.reset()
    kept = Kept(max((c.hi for c in chunks if c.needed), default=0), budget)
    grad_out = torch.zeros(
        (t, model.config.hidden_size), dtype=torch.promote_types(dtype, torch.float32), device=dev
    )
    total = 0.0
    slices: list[dict[str, float]] = []
    with torch.no_grad():  # pass 1: layer-major forward, keeping each layer's input
        h = net.embed(tb.input_ids)
        for li in range(n_layers):
            store.put(li, h)
            nxt = torch.empty_like(h)
            for i, c in enumerate(chunks):
                nxt[c.lo : c.hi] = net.run(li, i, h[c.lo : c.hi], _OneLayer(ChunkCache(kept, c, False, dev)))
            h = nxt
        with torch.enable_grad():  # the loss per chunk at the top: the gradient of the last layer's output
            for c in chunks:
                if c.targets.shape[0]:
                    x = h[c.lo : c.hi].detach().requires_grad_()
                    outs: list[torch.Tensor] = []
                    grads: list[torch.Tensor] = []
                    total += sliced_loss_backward(
                        net.head, net.norm(x), tb, c, loss_cfg, loss_slice, slices, outs, grads
                    )
                    torch.autograd.backward(outs, grads)
                    assert x.grad is not None
                    grad_out[c.lo : c.hi] = x.grad
        del h, nxt
    for li in reversed(range(n_layers)):  # pass 2: down the layers, chunks in reverse within each
        hin = store.get(li)
        if li:
            store.prefetch(li - 1)
        _layer_backward(net, li, hin, chunks, kept, grad_out, dev)
        del hin
    for c in chunks:  # the embedding's gradient, a chunk at a time
        torch.autograd.backward(net.embed(tb.input_ids[c.lo : c.hi]), grad_out[c.lo : c.hi].to(dtype))
    return {
        **tree_metrics(b, total, slices),
        "chunks": float(len(chunks)),
        "shared_chunks": float(sum(c.needed for c in chunks)),
        "joined_in_place": float(kept.in_place / n_layers),
        "joined_gathered": float(kept.gathered / n_layers),
        "host_bytes": float(store.host_bytes),
        "host_copies": float(store.copies),
        "transfer_s": store.transfer_seconds(),
    }


def _layer_backward(
    net: _Layers,
    li: int,
    hin: torch.Tensor,
    chunks: list[Chunk],
    kept: Kept,
    grad_out: torch.Tensor,
    dev: torch.device,
) -> None:
    """Turn `grad_out` (the gradient of layer `li`'s output) into that of its input, in place, adding the
    layer's parameter gradients: the shared chunks' keys/values recomputed from `hin`, then every chunk in
    reverse with autograd over its ancestors' keys/values, as `chunked.py` does through the whole model."""
    with torch.no_grad():
        for i, c in enumerate(chunks):
            if c.needed:
                with contextlib.suppress(_Captured):
                    net.run(li, i, hin[c.lo : c.hi], _Capture(kept, c))
        for ak, av in kept.acc:
            ak.zero_()
            av.zero_()
    for i in reversed(range(len(chunks))):
        c = chunks[i]
        cache = ChunkCache(kept, c, True, dev)
        x = hin[c.lo : c.hi].detach().requires_grad_()
        out = net.run(li, i, x, _OneLayer(cache))
        outs = [out]
        grads = [grad_out[c.lo : c.hi].to(out.dtype)]
        if c.needed:
            (k, v), (ak, av) = cache.own[0], kept.acc[0]
            outs += [k, v]
            grads += [ak[:, :, c.lo : c.hi].to(k.dtype), av[:, :, c.lo : c.hi].to(v.dtype)]
        torch.autograd.backward(outs, grads)
        assert x.grad is not None
        grad_out[c.lo : c.hi] = x.grad
        del cache, out, outs, grads, x
