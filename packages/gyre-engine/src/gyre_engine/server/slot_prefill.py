"""Packed prefills of a few calls straight into free decode slots, replayed as CUDA graphs.

An agent's next call extends its cached context by tens to hundreds of tokens. Prefilled eagerly
(`prefill.prefill_packed`: the rows' prefixes copied into per-row caches, the model's kernels launched one
by one from Python, each layer's keys and values concatenated onto the caches, the result copied into a
decode slot), a pass of about 100 tokens took 53-130 ms on a GPU shared with a trainer and a second
engine (integration's `bench/h200_run.py` on `examples/h200-shared.toml`), where a decode step, one graph
replay, took 2.4 ms: the host launches the kernels slower than the GPU runs them (27 ms for one call of
32 tokens with the GPU to itself, on one H100: `bench/prefill_beside.py`).

Here the rows' prefixes are copied into free decode slots (`SlotBatch.write_slot`), and one forward pass
over the rows' new tokens, packed into one sequence and padded to a token bucket, runs as a captured
graph: every projection, norm and MLP on the packed tokens (each with its own position), and per layer one
`gyre::slot_prefill_attention`, which writes each token's key and value into its slot at its position and
attends over the slot's columns up to it (the decode kernel with query rows mapped to slots). Which slot
and column a token goes to are inputs of the graph, so one graph per token bucket serves every packing.
The logits of each row's last token are kept (`MAX_ROWS` of them, padded), its first token sampled from
them as before, and the row starts decoding in its slot without a copy (`SlotRowKV`,
`SlotBatch.start_row`).

It serves rows that fit: at most `MAX_ROWS`, free decode slots for each, at most the largest bucket of
new tokens in all, and room in a slot for each row's context and one decoded token. Others are
prefilled as before. It needs full-width decode slots (the buffer never moves while rows run); graphs
are kept while the weights and the buffer keep their addresses (`Engine.Config.keep_graphs`) and
captured again once after they moved. Without CUDA graphs (the CPU, `decode_slots = "eager"`) the same
pass runs eagerly, which is how its arithmetic is tested against `prefill_packed`.

Measured on one H100 (`bench/prefill_beside.py`): 4.3-9.9 ms a pass of one to eight calls alone against
27-133 ms eagerly, 13-23 ms beside a process that keeps the GPU busy; in the two cells of
`examples/h200-shared.toml` 18-28 ms a pass against 52-64 ms. The attention reads a call's slot once per
new token, cheap while the slot stays in the GPU's L2; larger passes stay eager.
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import Any

import torch

from gyre_engine.server import decode_attn  # noqa: F401  (registers gyre::slot_prefill_attention)
from gyre_engine.server.batch import RowKV, SlotRowKV, buffer_row
from gyre_engine.server.long_kv import attention_as
from gyre_engine.server.slots import SlotBatch, SlotCache

log = logging.getLogger(__name__)

ATTN_NAME = "gyre_slot_prefill"
MAX_ROWS = 8
"""Rows (calls) one graphed pass prefills at most: the logits it keeps."""
SMALLEST_BUCKET = 32


def token_buckets(max_tokens: int) -> list[int]:
    """The token counts a pass is padded to: powers of two from `SMALLEST_BUCKET` up to `max_tokens` (the
    last one `max_tokens` itself when it is not a power of two)."""
    if max_tokens <= 0:
        return []
    out = []
    b = SMALLEST_BUCKET
    while b < max_tokens:
        out.append(b)
        b *= 2
    out.append(max_tokens)
    return out


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function of the packed pass: `query` [1, H, T, D], `key`/`value` [1, KVH,
    T, D] (after norms and RoPE) are the packed tokens'; the slot buffer, each token's slot and its
    count of valid columns come as the model call's keyword arguments `gyre_kv`, `gyre_slot`,
    `gyre_valid` and `gyre_width`. The mask transformers hands in is a placeholder (ignored). Returns
    [1, T, H, D]."""
    layer = module.layer_idx
    assert isinstance(layer, int)
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    out = torch.ops.gyre.slot_prefill_attention(
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        kwargs["gyre_kv"],
        layer,
        kwargs["gyre_slot"],
        kwargs["gyre_valid"],
        kwargs["gyre_width"],
        scale,
    )
    return out[None], None


class SlotPrefill:
    """Packed prefills into the free slots of `slots` (see the module docstring), for passes of up to
    `max_tokens` new tokens."""

    def __init__(self, slots: SlotBatch, max_tokens: int) -> None:
        if not (slots.full_width and not slots.dedicated):
            raise ValueError("slot prefill needs full-width decode slots")
        self.slots = slots
        self.buckets = token_buckets(max_tokens)
        self.max_tokens = self.buckets[-1] if self.buckets else 0
        dev = slots.device
        # rows: input ids, positions, slots, valid columns; then the kept logits' token indices
        self.io = torch.zeros((4, max(self.max_tokens, 1)), dtype=torch.long, device=dev)
        self.last = torch.zeros(MAX_ROWS, dtype=torch.long, device=dev)
        self.mask = torch.ones((1, 1, 1, 1), device=dev)  # handed through to the attention untouched
        self._graphs: dict[int, tuple[Any, torch.Tensor]] = {}
        self._pool: Any = None
        self._epoch = slots.graph_epoch
        """The slots' `graph_epoch` the graphs were captured in: the slots drop theirs whenever the
        buffer or the weights move, and these go with them."""
        self.stats = {
            "prefill_captures": 0,
            "prefill_capture_s": 0.0,
            "prefill_replays": 0,
            "prefill_eager": 0,
        }

    def fits(self, rows: list[tuple[int, int]]) -> bool:
        """Whether one pass serves these rows ((context length, new tokens) each): see the module
        docstring."""
        return (
            0 < len(rows) <= min(MAX_ROWS, self.slots.free())
            and sum(n for _, n in rows) <= self.max_tokens
            and all(0 < n <= length and self.slots.fits(length) for length, n in rows)
            and self.slots.capacity == self.slots.max_len
        )

    @torch.inference_mode()
    def run(self, rows: list[tuple[RowKV | None, list[int], int]]) -> tuple[torch.Tensor, list[SlotRowKV]]:
        """Prefill each row's `ctx[start:]` on top of its cached prefix (`kv`, covering `ctx[:start]`)
        into the next free decode slots, in one pass (check `fits` first). Returns each row's last
        logits [G, V] (valid until the next pass) and its KV in its slot."""
        slots = self.slots
        first = len(slots)
        ids: list[int] = []
        pos: list[int] = []
        where: list[int] = []
        last: list[int] = []
        for i, (kv, ctx, start) in enumerate(rows):
            if kv is not None:
                slots.write_slot(first + i, kv)
            ids.extend(ctx[start:])
            pos.extend(range(start, len(ctx)))
            where.extend([first + i] * (len(ctx) - start))
            last.append(len(ids) - 1)
        t = next(b for b in self.buckets if b >= len(ids))
        pad = t - len(ids)
        host = torch.zeros((4, t), dtype=torch.long)
        host[0, : len(ids)] = torch.tensor(ids)
        host[1, : len(ids)] = torch.tensor(pos)
        host[2] = torch.tensor(where + [where[-1]] * pad)  # padding writes into the last row's last column
        host[3, : len(ids)] = host[1, : len(ids)] + 1
        keep = torch.tensor(last + [last[-1]] * (MAX_ROWS - len(last)))
        self.io[:, :t].copy_(host)
        self.last.copy_(keep)
        logits = self._pass(t)
        views = [buffer_row(slots.kv, len(ctx), first + i) for i, (_, ctx, _) in enumerate(rows)]
        out = [SlotRowKV(v.keys, v.values, first + i) for i, v in enumerate(views)]
        return logits[: len(rows)], out

    def _forward(self, t: int) -> torch.Tensor:
        """The packed pass over the first `t` tokens of `io`: the kept logits [MAX_ROWS, V]."""
        slots = self.slots
        with attention_as(slots.model, ATTN_NAME, _attention), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = slots.model(
                input_ids=self.io[0, :t][None],
                position_ids=self.io[1, :t][None],
                attention_mask=self.mask,
                use_cache=True,
                logits_to_keep=self.last,
                gyre_kv=slots.kv,
                gyre_slot=self.io[2, :t],
                gyre_valid=self.io[3, :t],
                gyre_width=slots.capacity,
                **{slots.cache_kw: SlotCache()},
            )
        return out.logits[0]

    def _pass(self, t: int) -> torch.Tensor:
        if not self.slots.use_graphs:
            self.stats["prefill_eager"] += 1
            return self._forward(t)
        if self._epoch != self.slots.graph_epoch:  # the buffer or the weights moved: graphs hold addresses
            self._graphs.clear()
            self._pool, self._epoch = None, self.slots.graph_epoch
        got = self._graphs.get(t)
        if got is None:
            got = self._capture(t)
        got[0].replay()
        self.stats["prefill_replays"] += 1
        return got[1]

    def _capture(self, t: int) -> tuple[Any, torch.Tensor]:
        """Capture the pass for bucket `t` over the inputs in `io` (one warm-up run first, on the slots'
        capture stream: its writes land where the replay writes the same values)."""
        t0 = time.perf_counter()
        stream = self.slots.capture_stream()
        stream.wait_stream(torch.cuda.current_stream(self.slots.device))
        with torch.cuda.stream(stream):
            self._forward(t)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                logits = self._forward(t)
            finally:
                graph.capture_end()
        torch.cuda.current_stream(self.slots.device).wait_stream(stream)
        self._graphs[t] = (graph, logits)
        self.stats["prefill_captures"] += 1
        self.stats["prefill_capture_s"] += time.perf_counter() - t0
        return graph, logits

    @torch.inference_mode()
    def warmup(self) -> None:
        """Capture every bucket's graph now (no row may be running: the warm-up passes write padding into
        the last column of slot 0)."""
        if not self.slots.use_graphs or not self.buckets:
            return
        if len(self.slots):
            raise RuntimeError("warm up the prefill graphs before any row runs")
        self.slots.allocate()
        self.io.zero_()
        self.last.zero_()
        for t in self.buckets:
            self._pass(t)
