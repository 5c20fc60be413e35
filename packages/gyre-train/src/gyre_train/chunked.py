"""Training one execution tree larger than a micro-batch with every shared token computed once.

The whole tree is tree-packed (DFS preorder) and cut into chunks of at most `budget` tokens. A chunk's
queries see the keys and values of their ancestors in earlier chunks (gathered, `ext`) plus the chunk's
own, under the same ancestor test as one big batch (`kv <= q <= last_desc[kv]`, global indices). Pass 1
runs, without autograd, only the chunks some later chunk attends to (the shared prefix) and keeps their
keys and values. Pass 2 goes over the chunks in reverse: each is run with autograd on detached copies of
its ancestors' keys and values, backward once with its own loss plus the gradient that later chunks sent
to its keys and values, and passes the gradient of the gathered ancestors back to their chunks. So each
token is forwarded once (twice if shared), backward once, activation memory is one chunk's, and the
kept keys and values grow with the shared prefix only. The gradient equals that of the whole tree as one
micro-batch (tested on the CPU within float tolerance).
"""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gyre_traj.loss import LossConfig, TorchBatch, policy_loss
from gyre_traj.pack import PackedBatch

from gyre_train.model import Attention


@dataclass(frozen=True)
class Chunk:
    lo: int
    hi: int
    """Token range [lo, hi) of the packed tree."""
    ext: np.ndarray
    """Indices < lo whose subtree reaches into the chunk: the chunk's ancestors in earlier chunks."""
    needed: bool
    """Some later chunk attends to this chunk's tokens (so its keys and values are kept)."""
    targets: np.ndarray
    """Loss-array indices whose predicting position (target_pos) lies in this chunk."""


def plan(b: PackedBatch, budget: int) -> list[Chunk]:
    """Cut a tree-packed batch into chunks of at most `budget` tokens, preferring cuts at branch starts."""
    if budget < 1:
        raise ValueError("budget must be >= 1")
    t = b.num_tokens
    starts = np.flatnonzero(b.parent != np.arange(t) - 1)  # first tokens of runs (a root or a branch)
    bounds = [0]
    while bounds[-1] < t:
        lo = bounds[-1]
        limit = lo + budget
        if limit >= t:
            bounds.append(t)
            break
        i = int(np.searchsorted(starts, limit, side="right")) - 1
        s = int(starts[i]) if i >= 0 else -1
        bounds.append(s if s > lo + budget // 2 else limit)
    tp = b.target_pos.astype(np.int64)
    out = []
    for lo, hi in itertools.pairwise(bounds):
        ext = np.flatnonzero(b.last_desc[:lo] >= lo)
        needed = bool(np.any(b.last_desc[lo:hi] >= hi))
        out.append(Chunk(lo, hi, ext, needed, np.flatnonzero((tp >= lo) & (tp < hi))))
    return out


def _sub(tb: TorchBatch, idx: torch.Tensor, lo: int) -> TorchBatch:
    return TorchBatch(
        input_ids=tb.input_ids,
        position_ids=tb.position_ids,
        last_desc=tb.last_desc,
        target_pos=tb.target_pos[idx] - lo,
        target_ids=tb.target_ids[idx],
        old_logprobs=tb.old_logprobs[idx],
        advantages=tb.advantages[idx],
        weights=tb.weights[idx],
        versions=tb.versions[idx],
    )


def _mask(tb: TorchBatch, c: Chunk, kidx: torch.Tensor, attention: Attention) -> Any:
    q = torch.arange(c.lo, c.hi, device=kidx.device)
    if attention == "dense":
        ld = tb.last_desc[kidx]
        return ((kidx[None, :] <= q[:, None]) & (q[:, None] <= ld[None, :]))[None, None]
    from torch.nn.attention.flex_attention import create_block_mask

    # The kernel evaluates the mask on whole blocks, so key indices past the end occur: pad the lookup
    # tables to whole blocks (a key that is nobody's ancestor) rather than read out of range.
    n = int(kidx.shape[0])
    padded = -(-n // 128) * 128 + 128
    kpad = torch.full((padded,), 1 << 40, dtype=torch.long, device=kidx.device)
    kpad[:n] = kidx
    ld = torch.full((padded,), -1, dtype=tb.last_desc.dtype, device=kidx.device)
    ld[:n] = tb.last_desc[kidx]
    lo = c.lo

    def mask_mod(b: Any, h: Any, qi: Any, ki: Any) -> Any:
        return (kpad[ki] <= qi + lo) & (qi + lo <= ld[ki])

    return create_block_mask(
        mask_mod, None, None, c.hi - c.lo, n, device=str(kidx.device), BLOCK_SIZE=128, _compile=kidx.is_cuda
    )


def _forward(
    model: Any, tb: TorchBatch, c: Chunk, past: list[tuple[torch.Tensor, torch.Tensor]], attention: Attention
) -> tuple[torch.Tensor, Any]:
    from transformers import DynamicCache

    dev = tb.input_ids.device
    kidx = torch.cat(
        [torch.as_tensor(c.ext, device=dev, dtype=torch.long), torch.arange(c.lo, c.hi, device=dev)]
    )
    cache = DynamicCache(ddp_cache_data=past) if c.ext.shape[0] else DynamicCache()
    backbone = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    # transformers >= 5.2x names the argument `cache`; earlier 5.x releases call it `past_key_values`.
    arg = "cache" if "cache" in inspect.signature(backbone.forward).parameters else "past_key_values"
    out = backbone(
        input_ids=tb.input_ids[c.lo : c.hi][None],
        position_ids=tb.position_ids[c.lo : c.hi][None],
        attention_mask=_mask(tb, c, kidx, attention),
        use_cache=True,
        **{arg: cache},
    )
    return out.last_hidden_state[0], cache


def _kv(cache: Any, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The last n positions of each layer's keys and values."""
    return [(layer.keys[:, :, -n:, :], layer.values[:, :, -n:, :]) for layer in cache.layers]


def _where(ext: np.ndarray, dev: torch.device) -> slice | torch.Tensor:
    """Ancestor indices as a slice when they are one contiguous run, else an index tensor."""
    if ext.shape[0] and int(ext[-1]) - int(ext[0]) + 1 == ext.shape[0]:
        return slice(int(ext[0]), int(ext[-1]) + 1)
    return torch.as_tensor(ext, device=dev, dtype=torch.long)


def chunked_loss_backward(
    model: Any,
    b: PackedBatch,
    budget: int,
    loss_cfg: LossConfig,
    attention: Attention = "dense",
) -> dict[str, float]:
    """Accumulate into `.grad` the gradient of the policy loss of tree `b`, chunk by chunk (see module)."""
    chunks = plan(b, budget)
    dev = next(model.parameters()).device
    tb = TorchBatch.from_packed(b, device=dev)
    # Keys/values (and their gradients) are kept for the shared chunks only: up to the last one.
    t = max((c.hi for c in chunks if c.needed), default=0)
    keys: list[torch.Tensor] = []
    vals: list[torch.Tensor] = []
    gk: list[torch.Tensor] = []
    gv: list[torch.Tensor] = []
    where = {id(c): _where(c.ext, dev) for c in chunks}

    def gather(c: Chunk) -> list[tuple[torch.Tensor, torch.Tensor]]:
        w = where[id(c)]
        if isinstance(w, slice):  # a contiguous run of ancestors (a trunk): views, no copy
            return [(k[:, :, w], v[:, :, w]) for k, v in zip(keys, vals, strict=True)]
        return [(k.index_select(2, w), v.index_select(2, w)) for k, v in zip(keys, vals, strict=True)]

    with torch.no_grad():  # pass 1: keys and values of the shared chunks
        for c in chunks:
            if not c.needed:
                continue
            _, cache = _forward(model, tb, c, gather(c) if keys else [], attention)
            for li, (k, v) in enumerate(_kv(cache, c.hi - c.lo)):
                if len(keys) <= li:
                    shape = (k.shape[0], k.shape[1], t, k.shape[3])
                    keys.append(k.new_zeros(shape))
                    vals.append(v.new_zeros(shape))
                    gk.append(torch.zeros(shape, dtype=torch.float32, device=dev))
                    gv.append(torch.zeros(shape, dtype=torch.float32, device=dev))
                keys[li][:, :, c.lo : c.hi] = k
                vals[li][:, :, c.lo : c.hi] = v
    total = 0.0
    head = model.get_output_embeddings()
    for c in reversed(chunks):  # pass 2: one backward per chunk, reverse order
        past = (
            [(k.detach().requires_grad_(), v.detach().requires_grad_()) for k, v in gather(c)]
            if c.ext.shape[0]
            else []
        )
        hidden, cache = _forward(model, tb, c, past, attention)
        outs: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        if c.targets.shape[0]:
            sub = _sub(tb, torch.as_tensor(c.targets, device=dev), c.lo)
            logits = head(hidden.index_select(0, sub.target_pos)).float()
            if loss_cfg.temperature != 1.0:
                logits = logits / loss_cfg.temperature
            lp = torch.log_softmax(logits, -1).gather(1, sub.target_ids[:, None])[:, 0]
            loss, m = policy_loss(lp, sub, loss_cfg)
            total += m["loss"]
            outs.append(loss)
            grads.append(torch.ones_like(loss))
        if c.needed:
            for li, (k, v) in enumerate(_kv(cache, c.hi - c.lo)):
                outs += [k, v]
                grads += [gk[li][:, :, c.lo : c.hi].to(k.dtype), gv[li][:, :, c.lo : c.hi].to(v.dtype)]
        if outs:
            torch.autograd.backward(outs, grads)
        if past:
            w = where[id(c)]
            for li, (k, v) in enumerate(past):
                for acc, x in ((gk[li], k), (gv[li], v)):
                    if x.grad is None:
                        continue
                    if isinstance(w, slice):
                        acc[:, :, w] += x.grad
                    else:
                        acc.index_add_(2, w, x.grad.float())
    return {
        "loss": total,
        "chunks": float(len(chunks)),
        "shared_chunks": float(sum(c.needed for c in chunks)),
    }
