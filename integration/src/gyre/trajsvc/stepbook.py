"""What the trajectory service knows of each step: its batch's groups, their scores and records, what
was handed to gyre-train's core, and what to tell the scheduler.

A group is *ready* once every execution of it is scored and every model call the harness completed has
arrived as a record (records still missing `record_wait_s` after the last score are `RecordsMissing`).
`pack` selects (J_max), weights (group advantages) and tree-packs the executions of ready groups (an
execution with a path longer than the micro-batch budget cannot be packed: it is set aside, untrained,
and named in the step's summary, and the rest of its group trains); a step's `Tally` adds up what was given to the core, for the step's summary. `report` builds the
`ReadyGroups` the scheduler reads: the ready groups the trainer has not finished yet, counted from the
core's `StepInfo` (the step in progress first; a later step only once every earlier batch is complete),
whether the batch the next step trains is complete, and whether that step has begun training. The book
is owned by one thread (the service's); it does no IO.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gyre_sched.protocol import ReadyGroups
from gyre_train.protocol import StepInfo
from gyre_traj.pack import PackConfig, PackedBatch, PackItem, pack
from gyre_traj.records import Call, EvalStatus, RecordError, Score
from gyre_traj.select import SelectionConfig, select
from gyre_traj.tree import Forest
from gyre_traj.weights import group_advantages


class RecordsMissing(RuntimeError):
    """A scored group's records did not all arrive from the proxy within `record_wait_s`."""


@dataclass
class Packed:
    """Executions of some groups, selected, weighted and tree-packed (gyre-traj's whole-batch weights)."""

    items: list[PackItem]
    microbatches: list[PackedBatch]
    eval_failed: int
    groups: set[str]
    """The groups with at least one execution packed."""
    leaves: dict[str, dict[str, int]] = field(default_factory=dict)
    """execution id -> its tree's leaves (trajectories) by role."""
    dropped: int = 0
    """Trajectories J_max selection left out (leaves not selected), over the packed executions."""
    over_budget: dict[str, int] = field(default_factory=dict)
    """Executions set aside, untrained: execution id -> its longest selected path (tokens), which is over
    the micro-batch budget."""


@dataclass
class Tally:
    """What a step gave the core so far (one `add` per group when streaming, one for a whole step)."""

    trained: list[str] = field(default_factory=list)
    groups: set[str] = field(default_factory=set)
    """Groups with at least one execution trained."""
    eval_failed: int = 0
    microbatches: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    output_tokens: int = 0
    executions: int = 0
    """Executions with loss tokens (the divisor a streamed step is closed with)."""
    versions: list[np.ndarray] = field(default_factory=list)
    leaves_by_role: dict[str, dict[str, int]] = field(default_factory=dict)
    jmax_dropped: int = 0
    over_budget: dict[str, int] = field(default_factory=dict)

    def add(self, p: Packed, microbatches: Sequence[PackedBatch], executions: int) -> None:
        self.trained += [it.tree.execution_id for it in p.items]
        self.groups |= p.groups
        self.eval_failed += p.eval_failed
        self.microbatches += len(microbatches)
        self.tokens += sum(b.num_tokens for b in microbatches)
        self.loss_tokens += sum(b.num_loss_tokens for b in microbatches)
        self.output_tokens += sum(info.n_output for it in p.items for info in it.tree.calls.values())
        self.executions += executions
        self.versions += [b.versions for b in microbatches]
        self.leaves_by_role.update(p.leaves)
        self.jmax_dropped += p.dropped
        self.over_budget.update(p.over_budget)

    def summary(self, step: int, scores: Iterable[Score]) -> dict[str, Any]:
        scores = list(scores)
        versions = np.concatenate(self.versions) if self.versions else np.zeros(0, np.int32)
        lag = step - versions.astype(np.int64)
        valid = [s for s in scores if s.status is EvalStatus.OK]
        return {
            "step": step,
            "executions": len(scores),
            "trained_executions": list(self.trained),
            "eval_failed": self.eval_failed,
            "timed_out": sum(s.timed_out for s in valid),
            "mean_score": float(np.mean([s.value for s in valid])) if valid else None,
            "microbatches": self.microbatches,
            "tokens": self.tokens,
            "loss_tokens": self.loss_tokens,
            "output_tokens_recorded": self.output_tokens,
            "staleness_mean": float(lag.mean()) if lag.size else 0.0,
            "staleness_max": int(lag.max()) if lag.size else 0,
            "leaves_by_role": self.leaves_by_role,
            "jmax_dropped": self.jmax_dropped,
            "over_budget": dict(self.over_budget),
        }


@dataclass
class StepData:
    step: int
    groups: dict[str, list[str]]
    """group id -> execution ids."""
    scores: dict[str, Score] = field(default_factory=dict)
    calls_expected: dict[str, int] = field(default_factory=dict)
    scored_at: dict[str, float] = field(default_factory=dict)
    """group id -> when its last execution was scored (monotonic)."""
    ready: list[str] = field(default_factory=list)
    """Ready groups, in the order they became ready."""
    given: dict[str, int] = field(default_factory=dict)
    """Groups given to the core -> their micro-batches (streaming; in the order given)."""
    opened: bool = False
    closed: bool = False
    """Handed over whole: closed (streaming) or submitted."""
    tally: Tally = field(default_factory=Tally)
    summary: dict[str, Any] = field(default_factory=dict)
    first_given_at: float | None = None
    """Wall time the first micro-batch reached the core (None: none yet)."""
    closed_at: float | None = None

    @property
    def complete(self) -> bool:
        """Every group of the batch is ready."""
        return len(self.ready) == len(self.groups)


class StepBook:
    def __init__(
        self, batch_groups: int, *, streaming: bool, token_budget: int, j_max: int, record_wait_s: float
    ) -> None:
        self.batch_groups = batch_groups
        self.streaming = streaming
        self.pack_cfg = PackConfig(token_budget=token_budget, mode="tree")
        self.sel_cfg = SelectionConfig(j_max=j_max or None)
        self.record_wait_s = record_wait_s
        self.forest = Forest()
        self.steps: dict[int, StepData] = {}

    # ---- what comes in ------------------------------------------------------------------------------
    def register(self, step: int, groups: dict[str, list[str]]) -> None:
        self.steps[step] = StepData(step, groups)

    def record(self, rec: Call) -> bool:
        """Book a call (False: it was booked already, by call id in its execution); RecordError if its
        execution's tree refuses it."""
        if self.forest.booked(rec.execution_id, rec.call_id):
            return False
        self.forest.add(rec)
        return True

    def record_frame(self, data: bytes) -> bool:
        """Book a call record's message through the forest's live path (`Forest.ingest_call`: no
        decode of its own for a call the native path takes). False: the same call was booked already
        (the proxy sent it again); RecordError for anything else its tree refuses, or for a message
        that is not a call record."""
        try:
            self.forest.ingest_call(data)
        except RecordError:
            view = self.forest.read_view(data)  # (the refusal's path only: was it this call again?)
            if view is not None and self.forest.booked(view.execution_id, view.call_id):
                return False
            raise
        return True

    def calls_of(self, execution_id: str) -> int:
        """Calls booked so far for one execution."""
        tree = self.forest.trees.get(execution_id)
        return 0 if tree is None else len(tree.calls)

    def score(self, step: int, score: Score, calls: int, now: float) -> None:
        sd = self.steps[step]
        sd.scores[score.execution_id] = score
        sd.calls_expected[score.execution_id] = calls
        if all(e in sd.scores for e in sd.groups[score.group_id]):
            sd.scored_at[score.group_id] = now

    def update_ready(self, sd: StepData, now: float) -> None:
        """Mark the scored groups whose records have all arrived as ready; `RecordsMissing` if a group's
        records are still missing `record_wait_s` after its last score."""
        for g, at in sd.scored_at.items():
            if g in sd.ready:
                continue
            members = sd.groups[g]
            if all(self.calls_of(e) >= sd.calls_expected[e] for e in members):
                sd.ready.append(g)
            elif now - at > self.record_wait_s:
                missing = {e: (self.calls_of(e), sd.calls_expected[e]) for e in members}
                raise RecordsMissing(
                    f"step {sd.step}, group {g}: records missing after {self.record_wait_s}s "
                    f"(execution: (arrived, expected)): {missing}"
                )

    # ---- what goes out ------------------------------------------------------------------------------
    def pack(self, sd: StepData, groups: Iterable[str]) -> Packed:
        """Select, weight and tree-pack the executions of `groups` of step `sd` (each execution once)."""
        scores = [sd.scores[e] for g in groups for e in sd.groups[g]]
        adv, stats = group_advantages(scores)
        items: list[PackItem] = []
        leaves: dict[str, dict[str, int]] = {}
        over: dict[str, int] = {}
        for eid, a in sorted(adv.items()):
            tree = self.forest.trees.get(eid)
            if tree is None:
                continue
            sel = select(tree, self.sel_cfg)
            longest = max((int(tree.path_nodes(leaf.end).shape[0]) for leaf in sel.leaves), default=0)
            if longest > self.pack_cfg.token_budget:
                over[eid] = longest
                continue
            items.append(PackItem(tree, sel, a))
            leaves[eid] = dict(Counter(str(leaf.role) for leaf in tree.leaves()))
        groups = {sd.scores[it.tree.execution_id].group_id for it in items}
        dropped = sum(it.selection.dropped_leaves for it in items)
        mbs = pack(items, self.pack_cfg) if items else []
        return Packed(items, mbs, stats.eval_failed, groups, leaves, dropped, over)

    def untrained(self, sd: StepData, info: StepInfo | None) -> int:
        """Ready groups of step `sd` the trainer has not finished (`info`: the core's view of the step, if
        it has accepted it). Micro-batches are claimed in the order given, so the first `info.done` are
        taken as finished; a group that packed to nothing has nothing to train."""
        done = info.done if info is not None and info.training else 0
        if self.streaming:
            waiting = sum(g not in sd.given for g in sd.ready)  # ready, not yet given (this round)
            ends = np.cumsum([n for n in sd.given.values() if n > 0])
            return waiting + int((ends > done).sum())
        if not sd.complete:
            return 0  # whole steps: nothing of a batch is trainable before all of it is
        if not sd.closed:
            return len(sd.groups)
        total = sd.tally.microbatches  # one pack for the whole batch: groups share micro-batches
        return math.ceil(len(sd.tally.groups) * (total - done) / total) if total else 0

    def report(
        self, applied: int, version: int, infos: Mapping[int, StepInfo], hold: int | None = None
    ) -> ReadyGroups:
        """The scheduler's view: untrained ready groups from the step in progress (`applied`: the core's
        queue position) on, stopping after the first incomplete batch (steps train in order) and before
        step `hold` (held for an evaluation, which needs a rollout engine: groups that cannot be trained
        until it is done must not keep every cell training); whether that step's batch is complete;
        whether it has begun training."""
        ready = 0
        k = applied
        while k in self.steps and (hold is None or k < hold):
            sd = self.steps[k]
            ready += self.untrained(sd, infos.get(k))
            if not sd.complete:
                break
            k += 1
        head = self.steps.get(applied)
        info = infos.get(applied)
        return ReadyGroups(
            ready=ready,
            batch_groups=self.batch_groups,
            version=version,
            step_open=info is not None and info.training and info.claimed + info.done > 0,
            mean_staleness=self.last_staleness(applied),
            batch_complete=head is not None and head.complete,
        )

    def last_staleness(self, applied: int) -> float:
        done = [sd for k, sd in self.steps.items() if sd.closed and k < applied]
        return float(done[-1].summary.get("staleness_mean", 0.0)) if done else 0.0
