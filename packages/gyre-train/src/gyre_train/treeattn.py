"""Tree attention with no mask and nothing to compile: a tree-packed forward cut into runs of queries that
each see one causal context.

A run is a stretch of consecutive tokens each the parent of the next (one call's output, one tool output
appended to an agent's context, a trunk): token t of a run that starts at s sees the ancestors of s and
the run's own tokens up to t. So the run's attention is causal aligned to the bottom right over its keys
(the ancestors' columns, then its own), and on CUDA torch runs it with flash attention: no
[queries, keys] mask is built, masked blocks are never computed, and nothing is compiled. Columns that
make one contiguous stretch of the key tensor (a trunk; a first branch right after its trunk) are read
as a view; others are gathered (a copy of that run's ancestors' keys and values).

The runs are planned once per forward (`plan_runs`, on the host, from the packed tree's `last_desc`) and
reach every layer's attention as the keyword argument `gyre_tree`: transformers passes a model's
keyword arguments on to its attention function, registered under `ATTN_NAME` (`register`), which a model
switches to for one forward (`gyre_train.model.attention_implementation`). The gradient is that of the
same tree under a dense ancestor mask (tested on the CPU, whole micro-batches and chunks over kept keys).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from gyre_train.architecture import HF_ATTENTION

ATTN_NAME = HF_ATTENTION["tree"]
"""transformers' `attn_implementation` name of `tree_attention`."""


@dataclass(frozen=True)
class Run:
    lo: int
    hi: int
    """Query rows [lo, hi) of the forward."""
    cols: slice | np.ndarray
    """Key columns the run sees, its ancestors' then its own (the last hi - lo)."""


@dataclass(frozen=True)
class TreeRuns:
    """Every query row of one forward in runs, in order; what `tree_attention` takes as `gyre_tree`."""

    runs: tuple[Run, ...]
    keys: int
    """Columns of the key tensor the forward's layers attend over."""
    _on_device: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def gathers(self) -> int:
        """Runs whose columns are gathered rather than read as a view."""
        return sum(not isinstance(r.cols, slice) for r in self.runs)

    def columns(self, i: int, device: torch.device) -> slice | torch.Tensor:
        """Run `i`'s key columns as a slice, or as an index tensor on `device`, copied there once for
        every layer of the forward."""
        cols = self.runs[i].cols
        if isinstance(cols, slice):
            return cols
        key = (i, str(device))
        if key not in self._on_device:
            self._on_device[key] = torch.as_tensor(cols, device=device)
        return self._on_device[key]


def plan_runs(last_desc: np.ndarray, lo: int, hi: int, kidx: np.ndarray) -> TreeRuns:
    """The runs of queries [lo, hi) (global token indices of a tree-packed batch whose `last_desc` is
    given) over keys `kidx` (ascending global indices: the queries' ancestors before `lo`, then lo..hi-1,
    as `gyre_train.chunked` lays them out). A run starts at `lo` and wherever a token's predecessor is
    not its parent (`last_desc[t - 1] < t`: a root or a branch)."""
    if hi <= lo:
        raise ValueError(f"no queries: [{lo}, {hi})")
    kidx = np.asarray(kidx, dtype=np.int64)
    if kidx.shape[0] < hi - lo or not np.array_equal(kidx[-(hi - lo) :], np.arange(lo, hi)):
        raise ValueError("the keys must end with the queries' own tokens, lo..hi-1")
    ld = np.asarray(last_desc, dtype=np.int64)
    t = np.arange(lo + 1, hi)
    starts = np.concatenate([[lo], t[ld[t - 1] < t]]).astype(np.int64)
    ends = np.append(starts[1:], hi)
    own0 = kidx.shape[0] - (hi - lo)  # column of token lo
    runs = []
    for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
        anc = np.flatnonzero(ld[:s] >= s)
        cols = np.searchsorted(kidx, anc)
        if cols.size and not np.array_equal(kidx[cols], anc):
            raise ValueError(f"a run at {s} sees ancestors that are not among the keys")
        a, b = own0 + s - lo, own0 + e - lo
        if not cols.size or (cols[-1] + 1 == a and cols[-1] - cols[0] + 1 == cols.size):
            first = int(cols[0]) if cols.size else a
            runs.append(Run(s - lo, e - lo, slice(first, b)))
        else:
            runs.append(Run(s - lo, e - lo, np.concatenate([cols, np.arange(a, b)])))
    return TreeRuns(tuple(runs), int(kidx.shape[0]))


def whole_runs(last_desc: np.ndarray) -> TreeRuns:
    """The runs of a whole micro-batch attending over itself."""
    n = int(np.asarray(last_desc).shape[0])
    return plan_runs(last_desc, 0, n, np.arange(n))


def tree_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query [1, H, n, D], key/value [1, KVH, L, D]; returns the output
    [1, n, H, D]. Needs `gyre_tree` (a `TreeRuns` of these shapes) among the keyword arguments."""
    tr = kwargs.get("gyre_tree")
    if not isinstance(tr, TreeRuns):
        raise ValueError(f"{ATTN_NAME} attention needs gyre_tree=TreeRuns(...) passed to the model's forward")
    if query.shape[0] != 1 or key.shape[2] != tr.keys or tr.runs[-1].hi != query.shape[2]:
        raise ValueError(
            f"{ATTN_NAME}: queries {tuple(query.shape)} / keys {tuple(key.shape)} do not fit the runs "
            f"({tr.runs[-1].hi} queries over {tr.keys} keys)"
        )
    if dropout:
        raise ValueError(f"{ATTN_NAME} attention does not do dropout")
    group = query.shape[1] // key.shape[1]
    outs = []
    for i, r in enumerate(tr.runs):
        cols = tr.columns(i, key.device)
        if isinstance(cols, slice):
            k, v = key[:, :, cols], value[:, :, cols]
        else:
            k, v = key.index_select(2, cols), value.index_select(2, cols)
        outs.append(_causal_bottom_right(query[:, :, r.lo : r.hi], k, v, group, scaling))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, 2)
    return out.transpose(1, 2).contiguous(), None


def _causal_bottom_right(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int, scale: float | None
) -> torch.Tensor:
    """Query i of n sees key columns up to L - n + i. KV heads are repeated per query head so every
    kernel takes them (flash attention where the shapes allow, on CUDA)."""
    from torch.nn.attention.bias import causal_lower_right

    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    n, width = q.shape[2], k.shape[2]
    if n == width:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(n, width), scale=scale)


_registered = False


def register() -> None:
    """Make `ATTN_NAME` a transformers attention implementation (idempotent). No mask function is
    registered with it: transformers then hands the attention no mask, and the runs come as `gyre_tree`."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, tree_attention)
    _registered = True
