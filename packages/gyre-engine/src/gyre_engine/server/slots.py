"""Fixed decode slots over a preallocated KV cache, with the decode step captured as CUDA graphs.

The eager decode batch (`batch.py`) rebuilds a transformers `DynamicCache` and launches every kernel of
every layer from Python each step; on a GPU that, not memory bandwidth, bounds decode. Here each running
request owns a slot: row `i` of a static KV buffer (`[2, layers, slots, kv_heads, capacity, head_dim]`),
with its own length. One decode step is the transformers model's own forward, given

- `SlotCache`, a duck-typed cache whose `update` hands the step's new key/value through, and
- the attention function `gyre_slots` (registered through transformers' `AttentionInterface`), which
  passes the query, the new key/value and the buffer (a keyword argument of the model call, which
  transformers hands on to attention functions) to `gyre::slot_decode_attention` (`decode_attn.py`):
  it writes each row's new key/value at that row's position and computes grouped-query attention over
  each row's valid columns, in one Triton flash-decoding kernel on CUDA; in place of a mask the model
  is handed each row's count of valid columns.

On CUDA the step for a (batch bucket, length bucket, run length) is captured once as a
`torch.cuda.CUDAGraph` (optionally over a `torch.compile`d forward, which fuses the norms, rotary and
MLP elementwise work) and replayed; the inputs (token ids, positions) are copied into static buffers
before each replay. Padding rows of a bucket sit in free slots at position 0, so they never touch a
running row's KV; in the long slots (`dedicated`: rows keep their slot, and an idle slot may hold a
cached context) the slots a step covers besides its rows are holes at position -1, which the attention
neither reads nor writes. The head is captured too: what `sampling.sample` computes for a row without processing
or truncation (the float log-softmax at the row's temperature, the argmax for greedy rows, the same
seeded Gumbel-max draw for rows sampled at their temperature), as Triton kernels over vocabulary chunks
on CUDA (`head.py`) and torch ops elsewhere; such a batch runs several steps per replay, each step's
tokens feeding the next on the device (`step_run(steps, ...)`): one replay and one read-back per run.

Graphs read parameter storage in place: a weight update that copies into the parameters (all of
gyre-engine's do) needs no re-capture and lands between two replays, so no token mixes two versions;
anything that moves the parameters (release/resume of weights) drops the graphs (`check_weights`).
The same code runs without graphs (and on CPU), which is how its bookkeeping is tested without a GPU.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from typing import Any

import torch

from gyre_engine.server import (
    decode_attn,  # noqa: F401  (registers gyre::slot_decode_attention)
    vmem,
)
from gyre_engine.server import head as head_kernels
from gyre_engine.server.batch import RowKV, buffer_row, cache_kwarg
from gyre_engine.server.sampling import pick

log = logging.getLogger(__name__)

ATTN_NAME = "gyre_slots"
LEN_QUANTUM = 128
SLOT_FAMILIES = ("llama", "qwen2", "qwen3")
"""`model_type`s whose attention is what the slot step computes: softmax(q k^T * scaling) v over grouped
KV heads, the model's own RoPE (any type whose frequencies do not depend on the batch) and q/k norms
applied before, full attention in every layer. Other models decode in the lanes."""
BATCH_DEPENDENT_ROPE = ("dynamic", "longrope")
"""RoPE types that rescale with the longest sequence of the batch, so a row's logits would depend on the
rows beside it (in the lanes as in the slots; gyre-train refuses them)."""
_registered = False


def _slot_attention_interface(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function for a slot step. `key`/`value` are the step's own [B, KVH, 1, D]
    (`SlotCache.update` hands them through); the slot buffer and the step's column count come as the
    model call's keyword arguments `gyre_kv` and `gyre_width` (transformers passes a forward's extra
    keyword arguments on to the attention function), and in place of a mask `attention_mask` is the
    count of valid columns per row (position + 1) as a [B, 1, 1, 1] tensor, which transformers hands
    through untouched. `gyre::slot_decode_attention` writes the new key/value into the buffer and
    attends. Returns [B, 1, H, D]."""
    assert attention_mask is not None and attention_mask.dim() == 4
    valid = attention_mask.reshape(-1)
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    layer = module.layer_idx
    assert isinstance(layer, int)
    out = torch.ops.gyre.slot_decode_attention(
        query[:, :, 0],
        key[:, :, 0],
        value[:, :, 0],
        kwargs["gyre_kv"],
        layer,
        valid,
        kwargs["gyre_width"],
        scale,
    )
    return out[:, None], None


def register_attention() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_NAME, _slot_attention_interface)
        _registered = True


class SlotCache:
    """What the model's attention layers see as their cache during a slot step: `update` hands the new
    key/value through (the attention function writes them into the slot buffer, inside its kernel).
    Duck-typed (transformers 5.17 and 5.2x call `update(k, v, layer_idx, ...)`)."""

    def update(
        self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def _batch_buckets(slots: int, smallest: int = 1) -> list[int]:
    out = [smallest, 2, 4, 8, 16]
    n = 24
    while n < slots:
        out.append(n)
        n += 8 if n < 64 else 32
    return sorted({x for x in out if x < slots} | {slots})


def length_bucket(n: int) -> int:
    """Columns attended for rows of at most `n` tokens: a multiple of 128, with at most ~25% waste."""
    step = max(LEN_QUANTUM, (1 << max(0, math.ceil(math.log2(max(n, 1))) - 2)))
    return -(-n // step) * step


class SlotBatch:
    """The decode rows held in slots 0..n-1 (compact: a leaving row's slot is filled by the last one), or
    for the long slots (`dedicated`) each in a slot of its own that it keeps while it runs (`slot_of`).
    Same interface as `DecodeBatch` (`lengths`, `next_tokens`, `add_many`, `remove`, `row_kv`, `step`)."""

    def __init__(
        self,
        model: Any,
        slots: int,
        max_len: int,
        use_graphs: bool,
        compile_model: bool = False,
        full_width: bool = False,
        dedicated: bool = False,
        keep_addresses: bool = False,
    ) -> None:
        register_attention()
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        mc = model.config.get_text_config()
        self.layers = int(mc.num_hidden_layers)
        self.kv_heads = int(getattr(mc, "num_key_value_heads", None) or mc.num_attention_heads)
        self.head_dim = int(getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads)
        self.vocab = int(mc.vocab_size)
        self.slots = slots
        self.max_len = max_len
        self.use_graphs = use_graphs
        self.compile_model = compile_model
        self.full_width = full_width
        """Every step attends over the whole buffer (allocated at `max_len` at once) instead of the length
        bucket of its longest row: one graph per batch bucket and run length, captured at warm-up, none
        later and no buffer grows, at the cost of planning the attention's splits for the whole width
        (tiles past a row's length are still skipped). For contexts that keep growing."""
        self.dedicated = dedicated
        """The long slots (`long_kv.py`): the buffer is allocated at `max_len` at once (it never grows by
        copying); a row is prefilled in place in a slot the engine picks (`start_row`) and stays in that
        slot (rows never move: `remove` copies nothing), and a finished row's KV is handed on as views of
        its slot (`finished_kv`), not copied. A step covers slots 0 .. the highest running one; the
        others among them (free, being prefilled, or held by the prefix cache) are holes at position -1,
        whose KV the step neither reads nor writes. Widths stay bucketed unless `full_width`."""
        self.keep_addresses = keep_addresses and (full_width or dedicated) and vmem.supported(self.device)
        """The buffer (allocated whole) lives in a `vmem.DeviceRegion`: a release gives its memory back
        and keeps its addresses, so the graphs captured over it are kept too (see `release`)."""
        self._region: vmem.DeviceRegion | None = None
        self.cache_kw = cache_kwarg(model)
        self.lengths: list[int] = []
        self.next_tokens: list[int] = []
        self.slot_of: list[int] = []
        """The slot of each row (row i is slot i, except in the long slots)."""
        self.capacity = 0
        self.kv = torch.zeros(0, device=self.device)
        self._graphs: dict[tuple[int, int, int, bool], tuple[Any, torch.Tensor, torch.Tensor]] = {}
        self._pool: Any = None
        self.graph_epoch = 0
        """Counts the times the graphs were dropped (the buffer or the weights moved, or a capture
        failed): graphs captured elsewhere over this buffer and these weights (`slot_prefill.py`) are
        valid while it stays what it was at their capture."""
        self._stream: Any = None
        self._warmed: set[tuple[int, int, int, bool]] = set()
        """Step shapes (graph keys) that ran here since the forward was built: their graphs, dropped by a
        release or a grown buffer, are captured again after a one-step warm-up."""
        self._weights_fp: tuple[int, ...] = ()
        self._compiled: Any = None
        # a compiled forward specializes on a batch of 1, so one row runs in a bucket of 2 (same cost:
        # decode reads the weights once either way) and one compilation serves every bucket
        self.buckets = _batch_buckets(slots, 2 if compile_model and slots > 1 else 1)
        self.stats = {
            "captures": 0,
            "capture_s": 0.0,
            "warmup_steps": 0,
            "replays": 0,
            "eager_steps": 0,
            "grows": 0,
            "run_steps": 0,
        }
        self._alloc_io()

    # ------------------------------------------------------------------ support
    @staticmethod
    def unsupported(model: Any) -> str | None:
        """Why the slot path cannot serve this model (None if it can)."""
        mc = model.config.get_text_config()
        family = getattr(mc, "model_type", None)
        if family not in SLOT_FAMILIES:
            return f"model_type {family!r} (the slot step serves {', '.join(SLOT_FAMILIES)})"
        rope = getattr(mc, "rope_parameters", None) or getattr(mc, "rope_scaling", None) or {}
        kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
        if kind in BATCH_DEPENDENT_ROPE:
            return f"rope_type {kind!r} (its frequencies depend on the batch)"
        types = set(getattr(mc, "layer_types", None) or ["full_attention"])
        if types != {"full_attention"}:
            return f"layer types {sorted(types)} (only full attention is supported)"
        if getattr(mc, "sliding_window", None) and getattr(mc, "use_sliding_window", False):
            return "sliding-window attention"
        return None

    @staticmethod
    def token_bytes(model: Any) -> int:
        mc = model.config.get_text_config()
        kvh = int(getattr(mc, "num_key_value_heads", None) or mc.num_attention_heads)
        hd = int(getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads)
        return 2 * int(mc.num_hidden_layers) * kvh * hd * next(model.parameters()).element_size()

    # ------------------------------------------------------------------ buffers
    def _alloc_io(self) -> None:
        s, dev = self.slots, self.device
        # rows: input ids, positions, noise seeds, sampled (0/1); temperatures apart (float)
        self.io = torch.zeros((4, s), dtype=torch.long, device=dev)
        self.temps = torch.ones(s, dtype=torch.float32, device=dev)
        self._head: Any = None
        self._greedy: Any = None
        self.device_sampling = True
        """Whether rows sampled at their temperature may run here (false after a failed capture)."""
        self.cols = torch.arange(0, device=dev)

    @torch.inference_mode()
    def _ensure_capacity(self, need: int) -> None:
        """Make every slot hold at least `need` tokens (grow by doubling, copy, drop the graphs)."""
        if need <= self.capacity:
            return
        cap = max(512, self.capacity)
        while cap < need:
            cap *= 2
        fixed = self.full_width or self.dedicated
        cap = self.max_len if fixed else min(max(cap, need), self.max_len)
        shape = (2, self.layers, self.slots, self.kv_heads, cap, self.head_dim)
        if self.keep_addresses:
            if self._region is None:
                self._region = vmem.DeviceRegion(self.buffer_bytes(), self.device)
            else:  # the same addresses as before the release: the graphs captured over them hold
                self._region.map()
            self.kv = self._region.tensor(self.dtype, shape)
            self.kv.zero_()
            self.capacity = cap
            if self.cols.shape[0] != cap:
                self.cols = torch.arange(cap, device=self.device)
            return
        kv = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.capacity:
            n = max(self.lengths, default=0)
            kv[..., :n, :].copy_(self.kv[..., :n, :])
        self.kv, self.capacity = kv, cap
        self.cols = torch.arange(cap, device=self.device)
        self.drop_graphs()
        self.stats["grows"] += 1

    def buffer_bytes(self) -> int:
        """Bytes of the KV buffer at `max_len` tokens a slot."""
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * self.layers * self.slots * self.kv_heads * self.max_len * self.head_dim * itemsize

    def allocate(self) -> torch.Tensor:
        """The KV buffer, allocated to hold `max_len` tokens per slot if it does not yet."""
        self._ensure_capacity(self.max_len)
        return self.kv

    @torch.inference_mode()
    def release(self) -> None:
        """Free the KV buffer (no rows may be running), and the graphs unless the buffer's addresses are
        kept (`keep_addresses`: the graphs stay, with their memory pool, for the buffer mapped again at
        the same addresses by `allocate`)."""
        assert not self.lengths
        self.kv, self.capacity = torch.zeros(0, device=self.device), 0
        if self._region is not None:
            self._region.unmap()
        else:
            self.drop_graphs()

    def drop_graphs(self) -> None:
        self._graphs.clear()
        self._pool = None
        self.graph_epoch += 1

    def capture_stream(self) -> Any:
        """The side stream every warm-up and capture runs on (one for the slots' life)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def check_weights(self) -> None:
        """Drop the graphs if any parameter moved (graphs hold their addresses)."""
        fp = tuple(p.data_ptr() for p in self.model.parameters())
        if fp != self._weights_fp:
            self._weights_fp = fp
            self.drop_graphs()

    # ------------------------------------------------------------------ rows
    def __len__(self) -> int:
        return len(self.lengths)

    def free(self) -> int:
        return self.slots - len(self.lengths)

    def fits(self, length: int) -> bool:
        """Whether a row of `length` cached tokens can decode here at least one step."""
        return length + 1 <= self.max_len

    def full_rows(self) -> list[int]:
        """Rows whose next token would not fit their slot (they must leave for the eager path)."""
        return [i for i, n in enumerate(self.lengths) if n + 1 > self.max_len]

    @torch.inference_mode()  # the buffer is an inference tensor: writes happen in inference mode
    def add_many(self, rows: list[tuple[RowKV, int]]) -> None:
        if not rows:
            return
        if self.dedicated:
            raise RuntimeError("rows start in the long slots in place (start_row)")
        if len(self.lengths) + len(rows) > self.slots:
            raise RuntimeError("no free decode slot")
        self._ensure_capacity(max(kv.length for kv, _ in rows) + 1)
        for kv, tok in rows:
            i = len(self.lengths)
            self.write_slot(i, kv)
            self.lengths.append(kv.length)
            self.next_tokens.append(tok)
            self.slot_of.append(i)

    @torch.inference_mode()
    def write_slot(self, slot: int, kv: RowKV) -> None:
        """Copy `kv` into the first columns of slot `slot` (one copy of all layers for keys and one for
        values); the slot must not hold a running row."""
        n = kv.length
        if n:
            self.kv[0, :, slot, :, :n].copy_(torch.cat(kv.keys, dim=0))
            self.kv[1, :, slot, :, :n].copy_(torch.cat(kv.values, dim=0))

    def row_buffer(self, slot: int) -> torch.Tensor:
        """Slot `slot` of the buffer as a one-row buffer `[2, layers, 1, kv_heads, capacity, head_dim]`
        (a view: what a long prefill writes into)."""
        return self.kv[:, :, slot : slot + 1]

    @torch.inference_mode()
    def start_row(self, slot: int, length: int, next_token: int) -> None:
        """Add a row whose KV was written into slot `slot` in place (a long slot's prefill, or a packed
        prefill into free decode slots: `slot_prefill.py`). Decode slots stay compact: a row prefilled
        past the first free slot (one prefilled before it finished at once) moves down into it."""
        if not 0 <= slot < self.slots or slot in self.slot_of or (not self.dedicated and slot < len(self)):
            raise RuntimeError(f"slot {slot} is not a free slot")
        if not 0 < length < self.capacity:
            raise ValueError(f"a row of {length} tokens does not fit a slot of {self.capacity}")
        if not self.dedicated and slot != len(self):
            self.kv[:, :, len(self), :, :length].copy_(self.kv[:, :, slot, :, :length])
            slot = len(self)
        self.lengths.append(length)
        self.next_tokens.append(next_token)
        self.slot_of.append(slot)

    def finished_kv(self, row: int) -> RowKV:
        """What the prefix cache keeps of a finished row: one gathered copy of its valid KV, or in the long
        slots views of its slot (the row must leave at once: its slot is written again only once it has
        been taken back from the prefix cache)."""
        if self.dedicated:
            return buffer_row(self.kv, self.lengths[row], self.slot_of[row])
        return self.row_kv_copy(row)

    def add(self, kv: RowKV, next_token: int) -> None:
        self.add_many([(kv, next_token)])

    @torch.inference_mode()
    def remove(self, rows: list[int]) -> list[int]:
        """Drop rows: the last remaining rows move into the freed slots (one gather/scatter of whole slots,
        all layers at once; in the long slots nothing moves). Returns the old row indices in their new
        order."""
        gone = set(rows)
        if self.dedicated:
            keep = [i for i in range(len(self.lengths)) if i not in gone]
            self.lengths = [self.lengths[i] for i in keep]
            self.next_tokens = [self.next_tokens[i] for i in keep]
            self.slot_of = [self.slot_of[i] for i in keep]
            return keep
        n = len(self.lengths)
        new_n = n - len(gone)
        order = list(range(new_n))
        holes = [j for j in range(new_n) if j in gone]
        movers = [i for i in range(new_n, n) if i not in gone]
        for h, m in zip(holes, movers, strict=True):
            order[h] = m
        if holes:
            dst = torch.tensor(holes, device=self.device)
            src = torch.tensor(movers, device=self.device)
            self.kv.index_copy_(2, dst, self.kv.index_select(2, src))
        self.lengths = [self.lengths[i] for i in order]
        self.next_tokens = [self.next_tokens[i] for i in order]
        self.slot_of = list(range(new_n))
        return order

    def clear(self) -> None:
        self.lengths, self.next_tokens, self.slot_of = [], [], []

    def row_kv(self, row: int) -> RowKV:
        """The valid KV of one row (views of the slot buffer: clone before keeping it)."""
        n, s = self.lengths[row], self.slot_of[row]
        return RowKV(
            [self.kv[0, layer, s : s + 1, :, :n] for layer in range(self.layers)],
            [self.kv[1, layer, s : s + 1, :, :n] for layer in range(self.layers)],
        )

    @torch.inference_mode()
    def row_kv_copy(self, row: int) -> RowKV:
        """A copy of one row's valid KV, made by one gather into one tensor (the layers are views of it)."""
        s = self.slot_of[row]
        t = self.kv[:, :, s, :, : self.lengths[row]].clone()  # [2, layers, kv_heads, n, head_dim]
        return RowKV([t[0, i][None] for i in range(self.layers)], [t[1, i][None] for i in range(self.layers)])

    # ------------------------------------------------------------------ the step
    def _forward(
        self, ids: torch.Tensor, pos: torch.Tensor, cols: torch.Tensor, kv: torch.Tensor
    ) -> torch.Tensor:
        """Logits [b, V] of one decode step for rows 0..b-1 (input ids and positions [b]) over `cols`
        columns. Every input is contiguous whatever the bucket, so the compiled code does not specialize
        on the largest bucket (a [2, b] slice of the [2, slots] buffer is contiguous only at b = slots)."""
        # What the attention function takes in place of a mask: the count of valid columns per row, shaped
        # [B, 1, 1, 1] because every family's mask builder hands a 4D tensor through as it is (Qwen2/3 also
        # take a per-layer-type dict, Llama does not).
        valid = (pos + 1)[:, None, None, None]
        out = self.model(
            input_ids=ids[:, None],
            position_ids=pos[:, None],
            attention_mask=valid,
            use_cache=True,
            gyre_kv=kv,
            gyre_width=cols.shape[0],
            **{self.cache_kw: SlotCache()},
        )
        return out.logits[:, -1]

    def _run(
        self, b: int, width: int, steps: int = 1, sampled: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`steps` decode steps of rows 0..b-1 from the inputs in `io` and `temps`; after each step but
        the last, every row's token becomes its next input (on the device: no read-back between them).
        Each step's token is the head's: the argmax for greedy rows, a Gumbel-max draw at the row's
        temperature for sampled rows (only when `sampled`, else every row is greedy). Returns the last
        step's logits [b, V] and per step [steps, 2, b] (token id, logprob; float64 so that one read-back
        carries both)."""
        kernel_head = head_kernels.available(self.device)
        if self.compile_model and self._compiled is None:
            self._compiled = compile_fn(self._forward)
            if not kernel_head:
                self._head = compile_fn(_sampled_head)
                self._greedy = compile_fn(_greedy_head)
        fwd = self._compiled if self._compiled is not None else self._forward
        head = self._head if self._head is not None else _sampled_head
        greedy = self._greedy if self._greedy is not None else _greedy_head
        cfg = self.model.config
        old = cfg._attn_implementation
        cfg._attn_implementation = ATTN_NAME
        record = torch.empty((steps, 2, b), dtype=torch.float64, device=self.device)
        try:
            with warnings.catch_warnings():  # compilation warns (tf32 hints, ...); never an error here
                warnings.simplefilter("ignore")
                ids, pos, seeds, mask = self.io[0, :b], self.io[1, :b], self.io[2, :b], self.io[3, :b]
                for i in range(steps):
                    logits = fwd(ids, pos, self.cols[:width], self.kv)
                    more = i + 1 < steps
                    if kernel_head:  # greedy rows have mask 0 and temperature 1; the kernel writes the
                        head_kernels.decode_head(  # record and (between steps) the next inputs
                            logits[:, : self.vocab],
                            self.temps[:b],
                            mask,
                            seeds,
                            pos,
                            out=record[i],
                            next_ids=ids if more else None,
                        )
                    else:
                        if sampled:
                            chosen, lp = head(logits[:, : self.vocab], self.temps[:b], mask, seeds, pos + 1)
                        else:
                            chosen, lp = greedy(logits[:, : self.vocab])
                        record[i, 0].copy_(chosen)
                        record[i, 1].copy_(lp)
                        if more:
                            ids.copy_(chosen)
                    if more:  # holes of the long slots stay at -1
                        pos.add_(pos.ge(0).to(pos.dtype) if self.dedicated else 1)
        finally:
            cfg._attn_implementation = old
        return logits, record

    def _prepare(
        self, steps: int, temps: list[float] | None = None, seeds: list[int] | None = None
    ) -> tuple[int, int]:
        """Fill the step's inputs: row i at its slot; the other slots of the step are padding (free
        decode slots at position 0, whose writes land where no row reads) or, in the long slots, holes
        at position -1. Returns the batch (slots covered) and the columns attended."""
        span = max(self.slot_of) + 1
        top = max(self.lengths) + steps
        self._ensure_capacity(top)
        b = next(x for x in self.buckets if x >= span) if self.use_graphs else span
        width = self.capacity if self.full_width else min(length_bucket(top), self.capacity)
        host = torch.zeros((4, b), dtype=torch.long)
        if self.dedicated:
            host[1] = -1
        at = torch.tensor(self.slot_of, dtype=torch.long)
        host[0, at] = torch.tensor(self.next_tokens, dtype=torch.long)
        host[1, at] = torch.tensor(self.lengths, dtype=torch.long)
        t = torch.ones(b, dtype=torch.float32)
        if temps is not None and seeds is not None:
            host[2, at] = torch.tensor(seeds, dtype=torch.long)
            host[3, at] = torch.tensor([1 if x > 0 else 0 for x in temps], dtype=torch.long)
            t[at] = torch.tensor([x if x > 0 else 1.0 for x in temps], dtype=torch.float32)
        self.io[:, :b].copy_(host, non_blocking=False)
        self.temps[:b].copy_(t, non_blocking=False)
        return b, width

    def _graph_variants(self) -> tuple[bool, ...]:
        """The heads a step is captured with: one graph serves greedy and sampled rows alike where the
        head kernels run (greedy rows are the kernel's mask 0), else a greedy graph and, while rows may
        sample on the device, a sampled one."""
        if head_kernels.available(self.device) or not self.device_sampling:
            return (False,)
        return (False, True)

    def _graph(
        self, b: int, width: int, steps: int, sampled: bool = False
    ) -> tuple[Any, torch.Tensor, torch.Tensor]:
        sampled = sampled and len(self._graph_variants()) > 1
        key = (b, width, steps, sampled)
        got = self._graphs.get(key)
        if got is not None:
            return got
        t0 = time.perf_counter()
        if not self._weights_fp:
            self._weights_fp = tuple(p.data_ptr() for p in self.model.parameters())
        saved, saved_t = self.io.clone(), self.temps.clone()
        # The warm-up runs each kernel (and the compiler) once outside the capture. A step shape that ran
        # here before (its graph dropped by a release of the weights or a grown buffer) needs one eager
        # step, not two runs of `steps`: on a GPU shared with a trainer that was most of a capture's time.
        runs, run_steps = (1, 1) if key in self._warmed and not self.compile_model else (2, steps)
        stream = self.capture_stream()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # the step's own KV writes are recomputed identically by the replay
            try:
                for _ in range(runs):
                    self.io.copy_(saved)
                    self._run(b, width, run_steps, sampled)
            except Exception:
                if not self.compile_model:
                    raise
                log.exception("compiled decode step failed; capturing the eager forward instead")
                self._compiled, self._head, self._greedy, self.compile_model = None, None, None, False
                for _ in range(2):
                    self.io.copy_(saved)
                    self._run(b, width, steps, sampled)
            self.stats["warmup_steps"] += runs * run_steps
            self.io.copy_(saved)  # the replay starts from the same inputs
            self.temps.copy_(saved_t)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            # capture_begin/end on the side stream rather than `torch.cuda.graph`, whose entry synchronizes
            # the device and empties the allocator's cache (recent torch also its page-locked host cache),
            # so that later allocations go back to the driver: a capture between decode runs needs neither
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                logits, greedy = self._run(b, width, steps, sampled)
            finally:
                graph.capture_end()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self._warmed.add(key)
        self.io.copy_(saved)
        got = (graph, logits, greedy)
        self._graphs[key] = got
        self.stats["captures"] += 1
        self.stats["capture_s"] += time.perf_counter() - t0
        return got

    def _execute(
        self, steps: int = 1, temps: list[float] | None = None, seeds: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        sampled = temps is not None and any(x > 0 for x in temps)
        b, width = self._prepare(steps, temps, seeds)
        n = len(self.lengths)
        got = None
        if self.use_graphs:
            try:
                got = self._graph(b, width, steps, sampled)
            except Exception:
                if sampled:  # keep the greedy graphs; sampled rows go back to the host's `sample`
                    log.exception("capturing a sampling decode step failed; sampling on the host")
                    self.device_sampling = False
                else:
                    log.exception("capturing the decode step failed; decoding in slots without graphs")
                    self.use_graphs = False
                    self.drop_graphs()
        if got is not None:
            graph, logits, greedy = got
            graph.replay()
            self.stats["replays"] += 1
        else:
            logits, greedy = self._run(b, width, steps, sampled)
            self.stats["eager_steps"] += 1
        self.lengths = [x + steps for x in self.lengths]
        if steps > 1:
            self.stats["run_steps"] += steps
        if self.slot_of == list(range(n)):
            return logits[:n], greedy[:, :, :n]
        at = torch.tensor(self.slot_of, device=self.device)
        return logits[at], greedy[:, :, at]

    def can_run(self, steps: int) -> bool:
        """Whether every row has room for `steps` more tokens in its slot."""
        return bool(self.lengths) and max(self.lengths) + steps <= self.max_len

    @torch.inference_mode()
    def step(self, model: torch.nn.Module | None = None) -> torch.Tensor:
        """One decode step for every row; the last-position logits [n, V] (valid until the next step)."""
        return self._execute()[0]

    @torch.inference_mode()
    def step_run(
        self, steps: int = 1, temps: list[float] | None = None, seeds: list[int] | None = None
    ) -> tuple[list[list[int]], list[list[float]]]:
        """`steps` decode steps where no row needs logit processing or truncation, each step's tokens
        feeding the next on the device (check `can_run(steps)` first). Row i is greedy when `temps` is
        None or `temps[i]` is 0, else drawn at temperature `temps[i]` with noise seed `seeds[i]`
        (`sampling.pick`, indexed by the token's position). Returns per step the rows' tokens and
        logprobs. Every row's length grows by `steps`: a row that finished inside them has KV past its
        end, which `set_length` cuts before its KV is read."""
        _, greedy = self._execute(steps, temps, seeds)
        got = greedy.tolist()
        return [[int(t) for t in toks] for toks, _ in got], [lps for _, lps in got]

    def set_length(self, row: int, n: int) -> None:
        """Row `row` holds `n` valid tokens (cut after a multi-step run that went past its end)."""
        if not 0 < n <= self.lengths[row]:
            raise ValueError(f"row {row} holds {self.lengths[row]} tokens; cannot set {n}")
        self.lengths[row] = n

    @torch.inference_mode()
    def warmup(self, max_tokens: int, steps: tuple[int, ...] = (1,)) -> None:
        """Capture the graphs of every batch bucket and every length bucket for rows of up to
        `max_tokens` tokens, for each run length in `steps` and each head a row may need (greedy, and
        sampled at the row's temperature where that is a graph of its own): none is captured later in
        the middle of decoding rows of those lengths (no row may be running)."""
        if not self.use_graphs:
            return
        if self.lengths:
            raise RuntimeError("warm up the decode graphs before any row runs")
        top = min(max_tokens, self.max_len)
        self._ensure_capacity(top)
        widths = (
            [self.capacity]
            if self.full_width
            else sorted({min(length_bucket(n), self.capacity) for n in range(1, top + 1)})
        )
        self.io.zero_()  # rows at position 0 of free slots: their writes land where no row reads
        if self.dedicated:
            self.io[1].fill_(-1)  # holes: a long slot may hold a cached row
        for k in steps:
            for width in widths:
                if width < k:
                    continue
                for b in self.buckets:
                    for sampled in self._graph_variants():
                        self._graph(b, width, k, sampled)


def _greedy_head(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What `sampling.sample` computes for a greedy row without processing: the argmax of the float
    log-softmax and its logprob."""
    logp = torch.log_softmax(logits.float() / 1.0, dim=-1)
    chosen = torch.argmax(logp, dim=-1)
    return chosen, logp.gather(-1, chosen[:, None]).squeeze(-1)


def _sampled_head(
    logits: torch.Tensor, temps: torch.Tensor, mask: torch.Tensor, seeds: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """What `sampling.sample` computes for rows without processing or truncation: the log-softmax at each
    row's temperature (1 for greedy rows), the argmax (greedy rows, mask 0) or a Gumbel-max draw (mask
    1) keyed by the row's seed and the token's index, and the token's logprob."""
    logp = torch.log_softmax(logits.float() / temps[:, None], dim=-1)
    chosen = pick(logp, mask.bool(), seeds, index)
    return chosen, logp.gather(-1, chosen[:, None]).squeeze(-1)


def compile_fn(fn: Any) -> Any:
    with warnings.catch_warnings():  # importing Inductor warns (deprecations); a pytest "error" filter
        warnings.simplefilter("ignore")  # must not turn that into a failed compilation
        import torch._dynamo
        import torch._inductor.compile_fx

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 64))
    try:
        import torch.fx.experimental._config as fx_config

        fx_config.use_duck_shape = False  # keep the batch size its own symbol (no guard "batch == heads")
    except (ImportError, AttributeError):
        pass
    compiled = torch.compile(fn, dynamic=True, fullgraph=False)

    return compiled
