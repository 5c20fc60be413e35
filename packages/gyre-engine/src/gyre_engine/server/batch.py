"""The running decode batch: one transformers `DynamicCache` whose rows are requests, left-padded.

Rows of different lengths share the cache by left padding and a 2-D attention mask; each row keeps its
own position ids, so a row's logits equal those of the request run alone. Rows join after their prefill
(the batch is re-padded) and leave when finished (columns that are padding in every row are dropped).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache


@dataclass
class RowKV:
    """KV of one sequence: per layer, keys and values of shape [1, kv_heads, length, head_dim]."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[-2]) if self.keys else 0

    def crop(self, n: int) -> RowKV:
        return RowKV([k[:, :, :n] for k in self.keys], [v[:, :, :n] for v in self.values])

    def clone(self) -> RowKV:
        return RowKV([k.clone() for k in self.keys], [v.clone() for v in self.values])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


@dataclass
class LongRowKV(RowKV):
    """A row's KV held as views of row `row` of the long slots' buffer `buf` (handed to the prefix cache as
    it is: never cloned; the long slots take the row back when a later call extends or replaces the
    context)."""

    buf: torch.Tensor | None = None
    row: int = 0

    def crop(self, n: int) -> LongRowKV:
        return LongRowKV(
            [k[:, :, :n] for k in self.keys], [v[:, :, :n] for v in self.values], self.buf, self.row
        )


@dataclass
class SlotRowKV(RowKV):
    """A row's KV prefilled in place into decode slot `slot` (views of the decode slots' buffer,
    `slot_prefill.py`): the lanes start the row in its slot instead of copying it in; anything that keeps
    it longer (the prefix cache) copies it."""

    slot: int = 0


def buffer_row(buf: torch.Tensor, n: int, row: int = 0) -> LongRowKV:
    """The first `n` columns of row `row` of a slot buffer `[2, layers, rows, kv_heads, capacity,
    head_dim]` as a `LongRowKV` (views)."""
    layers = buf.shape[1]
    return LongRowKV(
        [buf[0, i, row : row + 1, :, :n] for i in range(layers)],
        [buf[1, i, row : row + 1, :, :n] for i in range(layers)],
        buf,
        row,
    )


def cache_kwarg(model: torch.nn.Module) -> str:
    """The keyword a model's forward takes its cache under (`cache` from transformers 5.2x on,
    `past_key_values` before)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_from_layers(keys: list[torch.Tensor], values: list[torch.Tensor]) -> DynamicCache:
    """A DynamicCache holding the given per-layer tensors (filled through the cache's own `update`)."""
    cache = DynamicCache()
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        cache.update(k, v, i)
    return cache


def cache_layers(cache: DynamicCache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer key and value tensors of a DynamicCache."""
    keys = [getattr(layer, "keys", None) for layer in cache.layers]
    values = [getattr(layer, "values", None) for layer in cache.layers]
    if any(k is None for k in keys) or any(v is None for v in values):
        raise RuntimeError("cache has an uninitialized layer")
    return keys, values  # type: ignore[return-value]


def _take(layers: list[torch.Tensor | None], i: int) -> torch.Tensor:
    """Layer `i`, its slot emptied (the caller's reference is then the last one)."""
    t = layers[i]
    assert t is not None
    layers[i] = None
    return t


class DecodeBatch:
    """Left-padded rows of running requests; `lengths[i]` valid tokens end at the last column."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=device)
        self.lengths: list[int] = []
        self.next_tokens: list[int] = []

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        return int(self.mask.shape[1])

    def add(self, kv: RowKV, next_token: int) -> None:
        """Append a row whose cache covers `kv.length` tokens and whose next input is `next_token`."""
        self.add_many([(kv, next_token)])

    def add_many(self, rows: list[tuple[RowKV, int]]) -> None:
        """Append several rows at once (one re-pad and copy of the cache, however many join)."""
        if not rows:
            return
        old_k: list[torch.Tensor | None] = []
        old_v: list[torch.Tensor | None] = []
        if self.cache is not None and self.lengths:
            ok, ov = cache_layers(self.cache)
            old_k, old_v = list(ok), list(ov)
        width = max([self.width if self.lengths else 0] + [kv.length for kv, _ in rows])
        grow = width - (self.width if self.lengths else 0)
        n_layers = len(rows[0][0].keys)
        keys, values = [], []
        self.cache = None  # each old layer is freed once its new one is built: one layer's copy at a time
        for layer in range(n_layers):
            ks = [_lpad(_take(old_k, layer), grow)] if old_k else []
            vs = [_lpad(_take(old_v, layer), grow)] if old_v else []
            ks += [_lpad(kv.keys[layer], width - kv.length) for kv, _ in rows]
            vs += [_lpad(kv.values[layer], width - kv.length) for kv, _ in rows]
            keys.append(torch.cat(ks, dim=0))
            values.append(torch.cat(vs, dim=0))
            del ks, vs
        masks = []
        if self.lengths:
            masks.append(
                torch.cat(
                    [torch.zeros((len(self), grow), dtype=torch.long, device=self.device), self.mask], dim=1
                )
            )
        for kv, _ in rows:
            row = torch.zeros((1, width), dtype=torch.long, device=self.device)
            row[:, width - kv.length :] = 1
            masks.append(row)
        self.mask = torch.cat(masks, dim=0)
        self.cache = cache_from_layers(keys, values)
        self.lengths += [kv.length for kv, _ in rows]
        self.next_tokens += [tok for _, tok in rows]

    def remove(self, rows: list[int]) -> None:
        """Drop rows (by index) and the columns that are then padding in every remaining row."""
        keep = [i for i in range(len(self)) if i not in set(rows)]
        if not keep:
            self.cache, self.lengths, self.next_tokens = None, [], []
            self.mask = torch.zeros((0, 0), dtype=torch.long, device=self.device)
            return
        assert self.cache is not None
        idx = torch.tensor(keep, device=self.device)
        lengths = [self.lengths[i] for i in keep]
        start = self.width - max(lengths)
        ok, ov = cache_layers(self.cache)
        old_k: list[torch.Tensor | None] = list(ok)
        old_v: list[torch.Tensor | None] = list(ov)
        del ok, ov
        self.cache = None  # as in add_many: one layer's copy at a time
        keys = [_take(old_k, i).index_select(0, idx)[:, :, start:] for i in range(len(old_k))]
        values = [_take(old_v, i).index_select(0, idx)[:, :, start:] for i in range(len(old_v))]
        self.cache = cache_from_layers(keys, values)
        self.mask = self.mask.index_select(0, idx)[:, start:]
        self.lengths = lengths
        self.next_tokens = [self.next_tokens[i] for i in keep]

    def row_kv(self, row: int) -> RowKV:
        """The valid KV of one row (a view; clone before keeping it)."""
        assert self.cache is not None
        keys, values = cache_layers(self.cache)
        start = self.width - self.lengths[row]
        return RowKV(
            [k[row : row + 1, :, start:] for k in keys], [v[row : row + 1, :, start:] for v in values]
        )

    @torch.inference_mode()
    def step(self, model: torch.nn.Module) -> torch.Tensor:
        """Run one decode step for every row; returns the last-position logits [B, V]."""
        assert self.cache is not None
        b = len(self)
        input_ids = torch.tensor(self.next_tokens, dtype=torch.long, device=self.device)[:, None]
        self.mask = torch.cat([self.mask, torch.ones((b, 1), dtype=torch.long, device=self.device)], dim=1)
        positions = torch.tensor(self.lengths, dtype=torch.long, device=self.device)[:, None]
        out = model(
            input_ids=input_ids,
            attention_mask=self.mask,
            position_ids=positions,
            use_cache=True,
            **{cache_kwarg(model): self.cache},
        )
        self.lengths = [n + 1 for n in self.lengths]
        return out.logits[:, -1]


def _lpad(t: torch.Tensor, n: int) -> torch.Tensor:
    if n == 0:
        return t
    return torch.cat([t.new_zeros((*t.shape[:2], n, t.shape[3])), t], dim=2)
