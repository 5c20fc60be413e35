"""J_max selection: which root-to-leaf trajectories of an execution are trained.

At most `j_max` leaves, ordered by role priority (default main > main_summary > subagent >
subagent_summary), then by configurable deterministic tie-breaks, the call id last. A leaf's role is
the role of the call that ends there. The loss tokens are the policy tokens on the union of the selected
paths, each counted once however many selected paths pass through it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from gyre_traj.records import Role
from gyre_traj.tree import CallInfo, ExecutionTree

TieBreak = Literal["policy_tokens", "length", "earliest", "latest"]


@dataclass(frozen=True)
class SelectionConfig:
    j_max: int | None = 5
    """Most trajectories trained per execution (None: all leaves)."""
    priority: tuple[Role, ...] = (Role.MAIN, Role.MAIN_SUMMARY, Role.SUBAGENT, Role.SUBAGENT_SUMMARY)
    """Roles in priority order; leaves of a role not listed are never selected."""
    tie_break: tuple[TieBreak, ...] = ("policy_tokens", "earliest")
    """Order among leaves of one role: more policy tokens on the path, longer path, earlier or later
    end time. The call id settles any remaining tie."""

    def __post_init__(self) -> None:
        if self.j_max is not None and self.j_max < 1:
            raise ValueError(f"j_max must be >= 1 or None, got {self.j_max}")
        if len(set(self.priority)) != len(self.priority):
            raise ValueError(f"priority lists a role twice: {self.priority}")
        bad = [t for t in self.tie_break if t not in ("policy_tokens", "length", "earliest", "latest")]
        if bad:
            raise ValueError(f"unknown tie_break {bad}; use policy_tokens, length, earliest or latest")


@dataclass(frozen=True)
class Selection:
    execution_id: str
    leaves: tuple[CallInfo, ...]
    """Selected leaves, in selection order."""
    nodes: np.ndarray = field(repr=False)
    """Sorted arena indices of the union of the selected paths."""
    loss_nodes: np.ndarray = field(repr=False)
    """Sorted arena indices of the policy tokens on the selected paths (each once)."""
    dropped_leaves: int
    dropped_policy_tokens: int
    """Policy tokens of the execution that no selected path reaches."""


def _path_policy_count(tree: ExecutionTree, end: int) -> int:
    return sum(int(tree.policy[lo:hi].sum()) for lo, hi in tree.path_slices(end))


def select(tree: ExecutionTree, cfg: SelectionConfig | None = None) -> Selection:
    cfg = cfg or SelectionConfig()
    rank = {r: k for k, r in enumerate(cfg.priority)}
    leaves = [leaf for leaf in tree.leaves() if leaf.role in rank]

    def key(leaf: CallInfo) -> tuple[object, ...]:
        parts: list[object] = [rank[leaf.role]]
        for tb in cfg.tie_break:
            if tb == "policy_tokens":
                parts.append(-_path_policy_count(tree, leaf.end))
            elif tb == "length":
                parts.append(-(int(tree.depth[leaf.end]) + 1))
            elif tb == "earliest":
                parts.append(leaf.t_end)
            else:
                parts.append(-leaf.t_end)
        parts.append(leaf.call_id)
        return tuple(parts)

    ordered = sorted(leaves, key=key)
    chosen = ordered if cfg.j_max is None else ordered[: cfg.j_max]
    mark = np.zeros(tree.n, np.bool_)
    for leaf in chosen:
        for lo, hi in tree.path_slices(leaf.end):
            mark[lo:hi] = True
    nodes = np.flatnonzero(mark)
    loss_nodes = nodes[tree.policy[nodes]]
    return Selection(
        execution_id=tree.execution_id,
        leaves=tuple(chosen),
        nodes=nodes,
        loss_nodes=loss_nodes,
        dropped_leaves=len(tree.leaves()) - len(chosen),
        dropped_policy_tokens=tree.policy_tokens - int(loss_nodes.shape[0]),
    )
