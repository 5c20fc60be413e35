"""Packing selected trajectories into micro-batches under a token budget.

Tree-packed (`mode="tree"`): the union of the selected paths, each unique token once, in DFS preorder, so
"kv is an ancestor-or-self of q" is `kv <= q <= last_desc[kv]`: a dense boolean mask for small batches,
a FlexAttention `mask_mod` for large ones. Position ids are tree depths. Path-expanded (`mode="paths"`):
every selected path on its own chain, the loss tokens an earlier path already carries masked out. Either
way each policy token carries loss exactly once per mini-batch, with weight 1 / (execution's loss tokens *
executions), and is predicted from its parent's position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from gyre_traj.records import ID_DTYPE
from gyre_traj.select import Selection
from gyre_traj.tree import ROOT, ExecutionTree
from gyre_traj.weights import execution_token_weights

PackMode = Literal["tree", "paths"]


class PackError(ValueError):
    """A trajectory does not fit the token budget, or inputs disagree."""


@dataclass(frozen=True)
class PackConfig:
    token_budget: int = 16384
    """Most tokens in one micro-batch (after de-duplication in tree mode)."""
    mode: PackMode = "tree"

    def __post_init__(self) -> None:
        if self.token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {self.token_budget}")
        if self.mode not in ("tree", "paths"):
            raise ValueError(f"mode must be 'tree' or 'paths', got {self.mode!r}")


@dataclass(frozen=True)
class PackItem:
    tree: ExecutionTree
    selection: Selection
    advantage: float


@dataclass(frozen=True)
class PackedBatch:
    """One micro-batch. Token arrays have length T, loss arrays length L."""

    mode: PackMode
    input_ids: np.ndarray
    position_ids: np.ndarray
    parent: np.ndarray
    """Local index of each token's parent, -1 at a root."""
    last_desc: np.ndarray
    """Local index of the last token of each token's subtree (DFS preorder)."""
    segment: np.ndarray
    """Index into `executions` of each token."""
    target_pos: np.ndarray
    """Local index of the token whose logits predict each target (the target's parent)."""
    target_ids: np.ndarray
    old_logprobs: np.ndarray
    advantages: np.ndarray
    weights: np.ndarray
    versions: np.ndarray
    target_nodes: np.ndarray
    """Arena index of each target in its execution's tree (with `segment[target_pos]`, names the token)."""
    executions: tuple[str, ...] = field(default=())

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_loss_tokens(self) -> int:
        return int(self.target_ids.shape[0])

    def dense_mask(self) -> np.ndarray:
        """[T, T] boolean, True where query row q may attend key column kv (kv ancestor-or-self of q)."""
        q = np.arange(self.num_tokens)[:, None]
        kv = np.arange(self.num_tokens)[None, :]
        return (kv <= q) & (q <= self.last_desc[None, :])

    def validate(self) -> None:
        """Structural checks a trainer runs before a forward pass; raises PackError naming the fault."""
        t = self.num_tokens
        for name in ("position_ids", "parent", "last_desc", "segment"):
            if getattr(self, name).shape != (t,):
                raise PackError(f"{name} has shape {getattr(self, name).shape}, expected ({t},)")
        n_loss = self.num_loss_tokens
        for name in ("target_pos", "old_logprobs", "advantages", "weights", "versions", "target_nodes"):
            if getattr(self, name).shape != (n_loss,):
                raise PackError(f"{name} has shape {getattr(self, name).shape}, expected ({n_loss},)")
        idx = np.arange(t)
        if np.any(self.parent >= idx) or np.any(self.parent < -1):
            raise PackError("parent indices must point to an earlier token or be -1")
        if np.any(self.last_desc < idx) or np.any(self.last_desc >= t):
            raise PackError("last_desc must lie in [own index, T)")
        has_parent = self.parent >= 0
        if np.any(self.position_ids[has_parent] != self.position_ids[self.parent[has_parent]] + 1):
            raise PackError("position_ids must be the parent's position + 1")
        if n_loss and (np.any(self.target_pos < 0) or np.any(self.target_pos >= t)):
            raise PackError("target_pos out of range")


def _preorder(tree: ExecutionTree, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Arena `nodes` (sorted, closed under ancestors) in DFS preorder: (order, local parent, last_desc)."""
    n = nodes.shape[0]
    if n == 0:
        z = np.zeros(0, np.int64)
        return z, z, z
    par = tree.parent[nodes].astype(np.int64)
    is_start = np.ones(n, np.bool_)
    is_start[1:] = (nodes[1:] != nodes[:-1] + 1) | (par[1:] != nodes[1:] - 1)
    starts = np.flatnonzero(is_start)
    lens = np.diff(np.append(starts, n))
    piece_of = np.cumsum(is_start) - 1
    head_parent = par[starts]
    has_par = head_parent != ROOT
    pos = np.searchsorted(nodes, head_parent[has_par])
    if np.any(pos >= n) or np.any(nodes[np.minimum(pos, n - 1)] != head_parent[has_par]):
        raise PackError(f"execution {tree.execution_id!r}: node set is not closed under ancestors")
    n_p = starts.shape[0]
    p_parent = np.full(n_p, -1, np.int64)
    p_off = np.zeros(n_p, np.int64)
    p_parent[has_par] = piece_of[pos]
    p_off[has_par] = pos - starts[piece_of[pos]]
    # Subtree sizes, children before parents (a child piece starts after its parent piece's head).
    size = lens.astype(np.int64).copy()
    kids: list[list[int]] = [[] for _ in range(n_p)]
    for p in range(n_p - 1, -1, -1):
        q = int(p_parent[p])
        if q >= 0:
            size[q] += size[p]
            kids[q].append(p)
    base = np.zeros(n_p, np.int64)
    order = np.empty(n, np.int64)
    local_parent = np.empty(n, np.int64)
    last_desc = np.empty(n, np.int64)
    cursor = 0
    for p in range(n_p):
        if p_parent[p] == -1:
            base[p] = cursor
            cursor += size[p]
        b, ln = int(base[p]), int(lens[p])
        order[b : b + ln] = nodes[starts[p] : starts[p] + ln]
        q = int(p_parent[p])
        local_parent[b] = -1 if q < 0 else base[q] + p_off[p]
        local_parent[b + 1 : b + ln] = np.arange(b, b + ln - 1)
        # Children in descending attach offset: the implicit chain first, then branches bottom-up.
        ks = sorted(kids[p], key=lambda k: -int(p_off[k]))
        nxt = b + ln
        offs = np.empty(len(ks), np.int64)
        ends = np.empty(len(ks), np.int64)
        for i, k in enumerate(ks):
            base[k] = nxt
            nxt += size[k]
            offs[i] = p_off[k]
            ends[i] = nxt - 1
        if not ks:
            last_desc[b : b + ln] = b + ln - 1
            continue
        cnt = np.searchsorted(-offs, -np.arange(ln), side="right")  # kids attached at offset >= t
        last_desc[b : b + ln] = np.where(cnt > 0, ends[np.maximum(cnt - 1, 0)], b + ln - 1)
    return order, local_parent, last_desc


@dataclass
class _Builder:
    """Collects the pieces of one micro-batch."""

    mode: PackMode
    per_exec: dict[int, list[np.ndarray]] = field(default_factory=dict)  # item index -> node arrays
    loss: dict[int, list[np.ndarray]] = field(default_factory=dict)
    marks: dict[int, np.ndarray] = field(default_factory=dict)
    size: int = 0

    def cost(self, item: int, tree: ExecutionTree, path: np.ndarray) -> int:
        if self.mode == "paths":
            return int(path.shape[0])
        mark = self.marks.get(item)
        return int(path.shape[0]) if mark is None else int((~mark[path]).sum())

    def add(
        self, item: int, tree: ExecutionTree, path: np.ndarray, loss_nodes: np.ndarray, cost: int
    ) -> None:
        self.size += cost
        self.per_exec.setdefault(item, []).append(path)
        self.loss.setdefault(item, []).append(loss_nodes)
        if self.mode == "tree":
            mark = self.marks.get(item)
            if mark is None:
                mark = self.marks[item] = np.zeros(tree.n, np.bool_)
            mark[path] = True


def pack(items: Sequence[PackItem], cfg: PackConfig | None = None) -> list[PackedBatch]:
    """Pack a mini-batch of executions into micro-batches (order: items, then selected paths)."""
    cfg = cfg or PackConfig()
    trees = [it.tree for it in items]
    names = [t.execution_id for t in trees]
    if len(set(names)) != len(names):
        raise PackError("an execution appears twice in one mini-batch")
    # Loss tokens need a parent to be predicted from; a policy token at depth 0 has no context.
    loss_sets = []
    for it in items:
        ln = it.selection.loss_nodes
        loss_sets.append(ln[it.tree.parent[ln] != ROOT])
    weights = execution_token_weights({names[i]: int(s.shape[0]) for i, s in enumerate(loss_sets)})
    batches: list[PackedBatch] = []
    cur = _Builder(cfg.mode)
    for i, it in enumerate(items):
        tree = it.tree
        counted = np.zeros(tree.n, np.bool_)
        is_loss = np.zeros(tree.n, np.bool_)
        is_loss[loss_sets[i]] = True
        for leaf in it.selection.leaves:
            path = tree.path_nodes(leaf.end)
            if path.shape[0] > cfg.token_budget:
                raise PackError(
                    f"execution {tree.execution_id!r}: path to call {leaf.call_id!r} has {path.shape[0]} "
                    f"tokens, over the micro-batch budget of {cfg.token_budget}; raise token_budget "
                    "(or train this execution with context parallelism)"
                )
            cost = cur.cost(i, tree, path)
            if cur.size + cost > cfg.token_budget and cur.size > 0:
                batches.append(_finish(cur, items, weights))
                cur = _Builder(cfg.mode)
                cost = cur.cost(i, tree, path)
            new_loss = path[is_loss[path] & ~counted[path]]
            counted[new_loss] = True
            cur.add(i, tree, path, new_loss, cost)
    if cur.size > 0:
        batches.append(_finish(cur, items, weights))
    return batches


def _finish(b: _Builder, items: Sequence[PackItem], weights: dict[str, float]) -> PackedBatch:
    tok: dict[str, list[np.ndarray]] = {k: [] for k in ("ids", "pos", "par", "desc", "seg")}
    loss: dict[str, list[np.ndarray]] = {k: [] for k in ("pos", "ids", "lp", "adv", "w", "ver", "node")}
    executions: list[str] = []
    offset = 0
    for seg, (item, paths) in enumerate(b.per_exec.items()):
        tree = items[item].tree
        executions.append(tree.execution_id)
        chains: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]
        if b.mode == "tree":
            order, lpar, ldesc = _preorder(tree, np.flatnonzero(b.marks[item]))
            chains = [(order, lpar, ldesc, np.concatenate(b.loss[item]))]
        else:
            chains = [
                (path, np.arange(-1, path.shape[0] - 1), np.full(path.shape[0], path.shape[0] - 1), ln)
                for path, ln in zip(paths, b.loss[item], strict=True)
            ]
        for order, lpar, ldesc, lnodes in chains:
            k = order.shape[0]
            tok["ids"].append(tree.ids[order])
            tok["pos"].append(tree.depth[order])
            tok["par"].append(np.where(lpar >= 0, lpar + offset, -1))
            tok["desc"].append(ldesc + offset)
            tok["seg"].append(np.full(k, seg))
            if lnodes.shape[0]:
                srt = np.argsort(order, kind="stable")
                loc = srt[np.searchsorted(order, lnodes, sorter=srt)]
                m = lnodes.shape[0]
                loss["pos"].append(lpar[loc] + offset)
                loss["ids"].append(tree.ids[lnodes])
                loss["lp"].append(tree.logprob[lnodes])
                loss["ver"].append(tree.version[lnodes])
                loss["node"].append(lnodes)
                loss["adv"].append(np.full(m, items[item].advantage))
                loss["w"].append(np.full(m, weights.get(tree.execution_id, 0.0)))
            offset += k

    def cat(parts: list[np.ndarray], dtype: np.dtype[Any] | type) -> np.ndarray:
        return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)

    return PackedBatch(
        mode=b.mode,
        input_ids=cat(tok["ids"], ID_DTYPE),
        position_ids=cat(tok["pos"], np.int32),
        parent=cat(tok["par"], np.int32),
        last_desc=cat(tok["desc"], np.int32),
        segment=cat(tok["seg"], np.int32),
        target_pos=cat(loss["pos"], np.int32),
        target_ids=cat(loss["ids"], np.int32),
        old_logprobs=cat(loss["lp"], np.float32),
        advantages=cat(loss["adv"], np.float32),
        weights=cat(loss["w"], np.float32),
        versions=cat(loss["ver"], np.int32),
        target_nodes=cat(loss["node"], np.int64),
        executions=tuple(executions),
    )
