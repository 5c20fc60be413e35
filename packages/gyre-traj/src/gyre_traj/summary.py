"""Per-execution summaries of a trajectory tree: token counts, de-duplication, branches by role, drift,
non-extensions and the selected trajectories. What `gyre-traj inspect` prints, as plain records.

A non-extension is a call whose record says it extends an earlier call (metadata `extends`: the harness
only appended to that call's conversation and output) while its input does not start with that call's
input + output: the writer failed to reuse the exact tokens. Drift sees only contradictions of policy
tokens; a missed reuse that re-renders an assistant turn usually diverges at a context token first (the
chat template's own markup) and shows up as a branch, which this count catches."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from gyre_traj.select import Selection, SelectionConfig, select
from gyre_traj.tree import ROOT, CallInfo, ExecutionTree

EXTENDS = "extends"
"""The `Call.metadata` key naming the call this one extends (see the module docstring)."""


@dataclass(frozen=True)
class TrajectoryLine:
    call_id: str
    role: str
    tokens: int
    policy_tokens: int


@dataclass(frozen=True)
class ExecutionSummary:
    execution_id: str
    calls: int
    delta_calls: int
    unique_tokens: int
    call_tokens: int
    """Sum of every call's input + output (the cost of storing or training calls separately)."""
    path_tokens: int
    """Sum of the lengths of every root-to-leaf path (the cost of path-by-path training)."""
    policy_tokens: int
    leaves_by_role: dict[str, int]
    drifts: int
    selected: tuple[TrajectoryLine, ...]
    selected_unique_tokens: int
    selected_path_tokens: int
    loss_tokens: int
    dropped_policy_tokens: int
    score: float | None
    score_status: str
    appended_calls: int = 0
    """Calls whose record names a call they extend (the harness only appended)."""
    non_extensions: int = 0
    """Of those, calls whose input does not start with the extended call's input + output."""

    @property
    def dedup_ratio(self) -> float:
        return self.call_tokens / max(1, self.unique_tokens)

    def as_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["dedup_ratio"] = self.dedup_ratio
        return d


def non_extensions(tree: ExecutionTree, extends: Mapping[str, str]) -> int:
    """How many calls of `extends` (call -> the call it extends) have an input that does not start with
    the extended call's input + output. A call whose extended call is not in the tree counts too."""
    bad = 0
    for cid, parent in extends.items():
        call, prev = tree.calls.get(cid), tree.calls.get(parent)
        if call is None:
            continue
        bad += not _starts_with(tree, call, prev)
    return bad


def _starts_with(tree: ExecutionTree, call: CallInfo, prev: CallInfo | None) -> bool:
    """Whether `call`'s input starts with `prev`'s input + output (the same path in the tree)."""
    if prev is None or call.n_input < prev.length:
        return False
    return prev.end == ROOT or tree.node_at_depth(call.end, prev.length - 1) == prev.end


def summarize(
    tree: ExecutionTree,
    cfg: SelectionConfig | None = None,
    selection: Selection | None = None,
    extends: Mapping[str, str] | None = None,
) -> ExecutionSummary:
    """`extends`: this execution's call -> extended call map (`Call.metadata["extends"]`), for the
    non-extension count."""
    sel = selection or select(tree, cfg)
    leaves = tree.leaves()
    lines = tuple(
        TrajectoryLine(
            leaf.call_id,
            leaf.role.value,
            int(tree.depth[leaf.end]) + 1,
            sum(int(tree.policy[lo:hi].sum()) for lo, hi in tree.path_slices(leaf.end)),
        )
        for leaf in sel.leaves
    )
    score = tree.score
    return ExecutionSummary(
        execution_id=tree.execution_id,
        calls=tree.stats.calls,
        delta_calls=tree.stats.delta_calls,
        unique_tokens=tree.n,
        call_tokens=tree.stats.call_tokens,
        path_tokens=sum(int(tree.depth[leaf.end]) + 1 for leaf in leaves),
        policy_tokens=tree.policy_tokens,
        leaves_by_role=dict(Counter(leaf.role.value for leaf in leaves)),
        drifts=len(tree.stats.drifts),
        selected=lines,
        selected_unique_tokens=int(sel.nodes.shape[0]),
        selected_path_tokens=sum(t.tokens for t in lines),
        loss_tokens=int(sel.loss_nodes.shape[0]),
        dropped_policy_tokens=sel.dropped_policy_tokens,
        score=None if score is None else score.value,
        score_status="unscored" if score is None else score.status.value,
        appended_calls=len(extends or {}),
        non_extensions=non_extensions(tree, extends or {}),
    )
