"""Training one execution tree larger than a micro-batch with every shared token computed once.

The whole tree is tree-packed (DFS preorder) and cut into chunks of at most `budget` tokens. A chunk's
queries see the keys and values of their ancestors in earlier chunks (`ext`) plus the chunk's own, under
the same ancestor test as one big batch (`kv <= q <= last_desc[kv]`, global indices). Pass 1 runs,
without autograd, only the chunks some later chunk attends to (the shared prefix) and keeps their keys
and values. Pass 2 goes over the chunks in reverse: each is run with autograd over its ancestors' kept
keys and values, backward once with its own loss plus the gradient that later chunks sent to its keys
and values, and passes the gradient of its ancestors' keys and values back into float32 accumulators.
So each token is forwarded once (twice if shared: pass 2 recomputes what pass 1 computed, as activation
checkpointing does), backward once, and activation memory is one chunk's. The gradient equals that of
the whole tree as one micro-batch (tested on the CPU within float tolerance).

Memory beyond one chunk's activations is the kept keys/values of the shared chunks (model dtype) and
their float32 gradient accumulators: per shared token, layers x kv_heads x head_dim x 2 x (dtype
bytes + 4). Nothing else grows with the tree: where a chunk's ancestors are one contiguous run that ends
where the chunk's own keys can be written (right after it: a trunk; or at the end of the kept region:
branches off a trunk), the attention reads a view of the kept buffer with the chunk's keys written in
place, and the ancestors' gradient is added straight into the accumulators by a custom autograd node
(`_Join`), so no per-chunk copy of the prefix's keys/values or of their gradient is ever made. Other
chunks (ancestors scattered over the tree) gather theirs (a copy of those ancestors only).
"""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gyre_traj.loss import LossConfig, TorchBatch, combine_metrics, merge_mismatch_sums, policy_loss
from gyre_traj.pack import PackedBatch

from gyre_train.architecture import HF_ATTENTION, Kernel
from gyre_train.treeattn import TreeRuns, plan_runs


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


def kept_bytes(b: PackedBatch, budget: int, model: Any) -> dict[str, int]:
    """What `chunked_loss_backward` keeps beyond one chunk's activations, in bytes: the shared chunks'
    keys/values (plus one chunk of scratch) and their float32 gradient accumulators."""
    chunks = plan(b, budget)
    t = max((c.hi for c in chunks if c.needed), default=0)
    cfg = model.config
    per = cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim(cfg) * 2
    item = next(model.parameters()).element_size()
    cap = t + budget if t else 0
    return {"shared_tokens": t, "kv_bytes": per * cap * item, "accumulator_bytes": per * t * 4}


def head_dim(cfg: Any) -> int:
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


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


def chunk_mask(
    tb: TorchBatch, c: Chunk, kidx: torch.Tensor, attention: Kernel, dtype: torch.dtype = torch.float32
) -> Any:
    """What chunk `c`'s queries may see of the keys `kidx` (its ancestors', then its own): for "dense" an
    additive mask of `dtype` (0 seen, -inf not) of shape [1, 1, queries, keys], made once for every layer
    (SDPA would otherwise turn a boolean mask into a new one at each layer and keep each for backward)
    and laid out with its rows a multiple of 16 apart, so the memory-efficient kernel takes it without a
    padded copy; for "flex" a BlockMask; for "tree" the chunk's runs (`treeattn.TreeRuns`), which the
    forward passes as `gyre_tree` (`model_inputs`)."""
    if attention == "tree":
        return plan_runs(tb.last_desc.cpu().numpy(), c.lo, c.hi, kidx.cpu().numpy())
    q = torch.arange(c.lo, c.hi, device=kidx.device)
    if attention == "dense":
        ld = tb.last_desc[kidx]
        seen = (kidx[None, :] <= q[:, None]) & (q[:, None] <= ld[None, :])
        n = int(kidx.shape[0])
        mask = torch.full(
            (1, 1, c.hi - c.lo, -(-n // 16) * 16), float("-inf"), dtype=dtype, device=kidx.device
        )
        mask[0, 0, :, :n].masked_fill_(seen, 0.0)
        return mask[..., :n]
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


class _Join(torch.autograd.Function):
    """Keys (or values) a chunk attends to: its ancestors' kept ones followed by its own. Forward returns
    `joined` (built by the caller: a view of the kept buffer with the chunk's own written in place, or
    a gathered copy); backward hands the own part's gradient to `own` and adds the ancestors' part into
    the float32 accumulator `acc` at `where` (a slice, or indices), so no gradient tensor of the prefix
    outlives the layer's backward."""

    @staticmethod
    def forward(
        ctx: Any, own: torch.Tensor, joined: torch.Tensor, acc: torch.Tensor, where: Any, n_ext: int
    ) -> torch.Tensor:
        ctx.acc, ctx.where, ctx.n_ext = acc, where, n_ext  # acc changes between chunks: not saved
        return joined.detach()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        n = ctx.n_ext
        if isinstance(ctx.where, slice):
            ctx.acc[:, :, ctx.where].add_(g[:, :, :n])
        else:
            ctx.acc.index_add_(2, ctx.where, g[:, :, :n].to(ctx.acc.dtype))
        return g[:, :, n:], None, None, None, None


class Kept:
    """Per layer, the kept keys and values ([1, kv_heads, t + budget, head_dim], model dtype: the shared
    region [0, t) and one chunk of scratch after it) and float32 gradient accumulators over [0, t)
    (float64 for a float64 model)."""

    def __init__(self, t: int, budget: int) -> None:
        self.t, self.cap = t, t + budget
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.acc: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.in_place = 0
        self.gathered = 0

    def buffers(self, layer: int, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        while len(self.kv) <= layer:  # allocated when the first chunk's layer produces its keys
            shape = (k.shape[0], k.shape[1], self.cap, k.shape[3])
            self.kv.append((k.new_zeros(shape), k.new_zeros(shape)))
            ashape = (k.shape[0], k.shape[1], self.t, k.shape[3])
            z = torch.zeros(ashape, dtype=torch.promote_types(k.dtype, torch.float32), device=k.device)
            self.acc.append((z, torch.zeros_like(z)))
        return self.kv[layer]


class ChunkCache:
    """What the model's attention layers see as their cache while one chunk runs (duck-typed: transformers
    5.x calls `update(key, value, layer_idx, ...)` and `get_seq_length()`): `update` returns the keys and
    values the chunk attends to, ancestors first, then its own."""

    def __init__(self, kept: Kept, c: Chunk, grad: bool, dev: torch.device) -> None:
        self.kept, self.c, self.grad = kept, c, grad
        self.own: list[tuple[torch.Tensor, torch.Tensor]] = []
        n = int(c.ext.shape[0])
        self.n_ext = n
        contiguous = n > 0 and int(c.ext[-1]) - int(c.ext[0]) + 1 == n
        self.a = int(c.ext[0]) if n else 0
        b = self.a + n
        # where the chunk's own keys go: its own place when its ancestors end right before it (a trunk),
        # the scratch after the kept region when they end there (branches off a trunk); else gathered
        self.dst = b if contiguous and (b == c.lo or b == kept.t) else -1
        self.idx = None if self.dst >= 0 or not n else torch.as_tensor(c.ext, device=dev, dtype=torch.long)
        if n and grad:  # counted once per chunk (pass 2)
            if self.dst >= 0:
                kept.in_place += 1
            else:
                kept.gathered += 1

    def update(
        self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        c, kept, n = self.c, self.kept, self.n_ext
        if self.grad:
            self.own.append((k, v))
        if not self.grad and c.needed:  # pass 1: keep this chunk's keys and values
            kb, vb = kept.buffers(layer_idx, k)
            kb[:, :, c.lo : c.hi] = k
            vb[:, :, c.lo : c.hi] = v
        if not n:
            return k, v
        kb, vb = kept.buffers(layer_idx, k)
        m = c.hi - c.lo
        if self.dst >= 0:
            if self.grad or self.dst != c.lo or not c.needed:  # (pass 1 wrote a shared chunk's own)
                with torch.no_grad():
                    kb[:, :, self.dst : self.dst + m] = k
                    vb[:, :, self.dst : self.dst + m] = v
            jk, jv = kb[:, :, self.a : self.dst + m], vb[:, :, self.a : self.dst + m]
            where: Any = slice(self.a, self.a + n)
        else:
            assert self.idx is not None
            jk = torch.cat([kb.index_select(2, self.idx), k.detach()], 2)
            jv = torch.cat([vb.index_select(2, self.idx), v.detach()], 2)
            where = self.idx
        if not self.grad:
            return jk, jv
        ak, av = kept.acc[layer_idx]
        return _Join.apply(k, jk, ak, where, n), _Join.apply(v, jv, av, where, n)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def check_kernel(model: Any, attention: Kernel) -> None:
    """Refuse to compute with masks of `attention` on a model whose attention implementation is another
    (tree runs given to SDPA would be ignored, silently): `gyre_train.model.attention_implementation`
    switches a model for a micro-batch."""
    want = HF_ATTENTION[attention]
    have = getattr(getattr(model, "config", None), "_attn_implementation", want)
    if have != want:
        raise ValueError(
            f"masks for {attention!r} attention need a model computing with {want!r}, not {have!r}"
        )


def model_inputs(mask: Any) -> dict[str, Any]:
    """The keyword arguments that hand a forward (a model's or one layer's) the mask of `chunk_mask`: a
    4D mask or BlockMask as the attention mask (it passes every family's mask builder as it is), tree
    runs beside no mask (transformers passes keyword arguments on to the attention function)."""
    if isinstance(mask, TreeRuns):
        return {"attention_mask": None, "gyre_tree": mask}
    return {"attention_mask": mask}


def _forward(model: Any, tb: TorchBatch, c: Chunk, cache: Any, attention: Kernel) -> torch.Tensor:
    check_kernel(model, attention)
    dev = tb.input_ids.device
    kidx = torch.cat(
        [torch.as_tensor(c.ext, device=dev, dtype=torch.long), torch.arange(c.lo, c.hi, device=dev)]
    )
    backbone = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    mask = chunk_mask(tb, c, kidx, attention, backbone.embed_tokens.weight.dtype)
    # transformers >= 5.2x names the argument `cache`; earlier 5.x releases call it `past_key_values`.
    arg = "cache" if "cache" in inspect.signature(backbone.forward).parameters else "past_key_values"
    out = backbone(
        input_ids=tb.input_ids[c.lo : c.hi][None],
        position_ids=tb.position_ids[c.lo : c.hi][None],
        use_cache=True,
        **model_inputs(mask),
        **{arg: cache},
    )
    return out.last_hidden_state[0]


def sliced_loss_backward(
    head: Any,
    hidden: torch.Tensor,
    tb: TorchBatch,
    c: Chunk,
    loss_cfg: LossConfig,
    loss_slice: int,
    slices: list[dict[str, float]],
    outs: list[torch.Tensor],
    grads: list[torch.Tensor],
) -> float:
    """The policy loss of chunk `c`'s targets off its final hidden states `hidden` ([chunk, hidden_size],
    with autograd), in slices of `loss_slice` targets off a detached copy, so the float32 logits (targets x
    vocabulary) of only one slice exist at a time: backward into the head per slice, each slice's metrics
    appended to `slices`, and `hidden` with its gradient appended to `outs`/`grads` for the caller's one
    backward through the chunk. Returns the summed loss."""
    dev = hidden.device
    h = hidden.detach().requires_grad_()
    total = 0.0
    for s in range(0, int(c.targets.shape[0]), loss_slice):
        sub = _sub(tb, torch.as_tensor(c.targets[s : s + loss_slice], device=dev), c.lo)
        logits = head(h.index_select(0, sub.target_pos))
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float32 at least
        if loss_cfg.temperature != 1.0:
            logits = logits / loss_cfg.temperature
        lsm = torch.log_softmax(logits, -1)
        lp = lsm.gather(1, sub.target_ids[:, None])[:, 0]
        with torch.no_grad():  # in row slices: the temporaries stay small on a 150k vocabulary
            entropy = torch.cat([-(s.exp() * s).sum(-1) for s in lsm.detach().split(256)])
        loss, m = policy_loss(lp, sub, loss_cfg, entropy)
        total += m["loss"]
        slices.append(m)
        loss.backward()
        del logits, lsm, lp, loss
    assert h.grad is not None
    outs.append(hidden)
    grads.append(h.grad)
    return total


def tree_metrics(b: PackedBatch, total: float, slices: list[dict[str, float]]) -> dict[str, float]:
    """A tree's metrics from its loss slices' (`sliced_loss_backward`) as a micro-batch computed in one
    piece reports them: the summed loss, its tokens, the weighted means and their weight (so a step's
    `combine_metrics` counts the tree like any micro-batch), and the mismatch sums of its newest tokens."""
    newest = int(b.versions.max()) if len(b.versions) else None
    return {
        **combine_metrics(slices),
        "loss": total,
        "weight": float(sum(s["weight"] for s in slices)),
        **merge_mismatch_sums(slices, newest),
    }


@torch.no_grad()
def tree_target_logprobs(
    model: Any, b: PackedBatch, attention: Kernel, loss_slice: int = 2048
) -> torch.Tensor:
    """Logprobs [L] of `b`'s loss targets at temperature 1, the whole micro-batch forwarded as one chunk
    with `attention` (the model switched to it by the caller), the log-softmax a slice of targets at a
    time: the forward `chunked_loss_backward` trains with, without the gradient."""
    dev = next(model.parameters()).device
    tb = TorchBatch.from_packed(b, device=dev)
    c = plan(b, max(1, b.num_tokens))[0]
    hidden = _forward(model, tb, c, ChunkCache(Kept(0, c.hi), c, False, dev), attention)
    head = model.get_output_embeddings()
    parts = []
    for s in range(0, int(tb.target_pos.shape[0]), loss_slice):
        logits = head(hidden.index_select(0, tb.target_pos[s : s + loss_slice]))
        lsm = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
        parts.append(lsm.gather(1, tb.target_ids[s : s + loss_slice, None])[:, 0])
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)


def chunked_loss_backward(
    model: Any,
    b: PackedBatch,
    budget: int,
    loss_cfg: LossConfig,
    attention: Kernel = "dense",
    loss_slice: int = 2048,
) -> dict[str, float]:
    """Accumulate into `.grad` the gradient of the policy loss of tree `b`, chunk by chunk (see module)."""
    chunks = plan(b, budget)
    dev = next(model.parameters()).device
    tb = TorchBatch.from_packed(b, device=dev)
    # Keys/values (and their gradients) are kept for the shared chunks only: up to the last one.
    kept = Kept(max((c.hi for c in chunks if c.needed), default=0), budget)
    with torch.no_grad():  # pass 1: keys and values of the shared chunks
        for c in chunks:
            if c.needed:
                _forward(model, tb, c, ChunkCache(kept, c, False, dev), attention)
    total = 0.0
    slices: list[dict[str, float]] = []
    head = model.get_output_embeddings()
    for c in reversed(chunks):  # pass 2: one backward per chunk, reverse order
        cache = ChunkCache(kept, c, True, dev)
        hidden = _forward(model, tb, c, cache, attention)
        outs: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        if c.targets.shape[0]:
            total += sliced_loss_backward(head, hidden, tb, c, loss_cfg, loss_slice, slices, outs, grads)
        if c.needed:
            for li, (k, v) in enumerate(cache.own):
                ak, av = kept.acc[li]
                outs += [k, v]
                grads += [ak[:, :, c.lo : c.hi].to(k.dtype), av[:, :, c.lo : c.hi].to(v.dtype)]
        if outs:
            torch.autograd.backward(outs, grads)
        del cache, hidden, outs, grads
    return {
        **tree_metrics(b, total, slices),
        "chunks": float(len(chunks)),
        "shared_chunks": float(sum(c.needed for c in chunks)),
        "joined_in_place": float(kept.in_place),
        "joined_gathered": float(kept.gathered),
    }
