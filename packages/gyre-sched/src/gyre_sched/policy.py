"""Scheduling policies: the water-level policy, its prediction-based variant, Colocate and Async.

A policy reads one `Observation` (aggregate counts only, so a decision costs the same with 100,000
executions as with 10) and the `CellTable`, and returns the switches to start now, each a `Decision`
with the rule that fired and the quantities behind it. Policies never change the table themselves: the
simulator and the service apply decisions through `CellTable.transition`, which checks the invariants.
Each policy also names its `Admission` (when a new batch may start; `batches_to_start` is the rule the
simulator applies, and the scheduler tells the live driver its policy's admission in `Welcome`) and
whether its cells move together.

Every policy runs under the same bounds: a batch starts at most `max_ahead` steps ahead of the trainer,
and none starts while the measured mean staleness is above the target E[d]. The names mean:

- `elastic`: cells move one at a time by the water level (below); ROLLING admission.
- `colocate` (the report's Colocate): the whole pool is either in rollout or in training, never split.
  A *cohort* of batches (as many as the bounds allow) starts together, and no execution starts while
  any execution of the cohort is still running, nor before all its batches are trained (COHORT
  admission). The pool moves to training, all together, when the oldest untrained batch is complete,
  freezing whatever else runs, trains whole batches only (never part of one), and moves back when the
  next batch is not complete. So while a cohort's slowest executions finish, only they run: every other
  slot of the pool waits idle and nothing trains. That wait is the cost the report attributes to
  Colocate.
- `colocate-runahead` (not the report's; what gyre called Colocate before): the same whole-pool
  switches, but ROLLING admission, so the next batches roll out under a batch's tail and hide that wait.
- `async`: a fixed split, `train_cells` cells train for the whole run and the rest roll out; ROLLING.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from gyre_sched.cells import SWITCHING, CellTable
from gyre_sched.predict import DurationModel, PredictConfig
from gyre_sched.protocol import Action, Admission, Decision, Role, Why

POLICY_NAMES: dict[str, str] = {
    "elastic": "cells move one at a time by the water level",
    "predictive": "elastic, counting executions predicted to time out as a fraction of a slot",
    "colocate": "the report's Colocate: the whole pool switches; a cohort of batches starts only once "
    "every earlier batch is trained",
    "colocate-runahead": "whole-pool switches, but batches start under earlier batches' tails (what "
    "colocate meant in earlier versions)",
    "async": "a fixed split of training and rollout cells",
}
"""Every policy name the service, the simulator and `gyre run` accept, with what it means."""


@dataclass(frozen=True, slots=True)
class Observation:
    """What the scheduler knows at `now`, as aggregates."""

    now: float
    unfinished: int
    """Executions running and needing rollout capacity (the water level)."""
    trainable: int
    """Ready groups the trainer may consume now for the step in progress (without streaming: 0 until
    the step's whole batch is ready)."""
    batch_groups: int
    """Groups in one optimizer step."""
    batch_complete: bool = False
    """Every execution of the batch the next step trains has finished."""
    step_open: bool = False
    """The trainer has begun accumulating a step and not yet applied it."""
    updating: bool = False
    """The optimizer step (and weight push) is running now."""
    version: int = 0
    mean_staleness: float = 0.0
    ages: tuple[float, ...] = ()
    """Unfinished executions bucketed by age: bucket ages (seconds) ..."""
    age_counts: tuple[int, ...] = ()
    """... and counts."""
    admission_held: bool = False
    """The driver has a batch left to start that the admission bound (`max_ahead`) holds back until the
    next step is applied."""

    @property
    def step_ready(self) -> bool:
        """The next step's batch is complete and not all trained: a whole step to train now."""
        return self.batch_complete and self.trainable > 0

    @property
    def step_unblocks(self) -> bool:
        """`step_ready`, and applying that step lets the driver start a batch it holds back: training it
        now keeps rollout fed later, whatever the water level now."""
        return self.admission_held and self.step_ready


class Policy(Protocol):
    name: str
    admission: Admission
    """When the driver may start a batch (see `batches_to_start`)."""
    moves_together: bool
    """Many cells may switch at once (whole-pool or fixed-split policies); else one at a time."""

    def decide(self, obs: Observation, cells: CellTable) -> list[Decision]: ...


def batches_to_start(admission: Admission, *, started: int, trained: int, max_ahead: int) -> int:
    """How many batches may start now, given `started` batches so far, `trained` steps applied and the
    shared `max_ahead` bound (a batch b may start once b <= trained + max_ahead). Whoever measures
    staleness narrows `max_ahead` on top of this (the simulator does; see `sim.Simulator._launch`).

    ROLLING: every batch the bound allows, whatever is still running. COHORT: none until every started
    batch is trained (so no execution runs); then all the bound allows, at once."""
    if admission is Admission.COHORT and trained < started:
        return 0
    return max(0, trained + max_ahead + 1 - started)


@dataclass(frozen=True, slots=True)
class WaterLevelConfig:
    ready_fraction: float = 0.25
    """(b): ready groups must stay at or above this fraction of the batch ... (report: "a set fraction";
    value not given)."""
    hold_s: float = 120.0
    """... for this long (report: "a set time"; value not given)."""
    headroom: float = 1.0
    """(a): the rollout capacity left after the switch must be >= headroom x unfinished executions."""
    return_above: float = 1.0
    """Demand returns when unfinished executions exceed this x the rollout capacity."""
    train_complete_steps: bool = True
    """Beside the report's rules, for a complete step (`Observation.step_ready`): a training core stays for
    it when demand returns, as it stays for a step it has opened (else a core that has just applied a
    step and not yet opened the next, its batch complete, goes back to rollout and leaves that step to
    wait for the water to fall); and a rollout core goes to train it at once, whatever the water level,
    when applying it lets the driver start a batch that `max_ahead` holds back (`step_unblocks`: else
    the next batch waits too). False: the report's rules alone."""


def _why(obs: Observation, cells: CellTable, cap_after: int, held: float, pred: float = 0.0) -> Why:
    return Why(
        unfinished=obs.unfinished,
        capacity_before=cells.rollout_capacity,
        capacity_after=cap_after,
        ready_groups=obs.trainable,
        batch_groups=obs.batch_groups,
        held_s=held,
        staleness=obs.mean_staleness,
        predicted_timeouts=pred,
    )


@dataclass(slots=True)
class WaterLevelPolicy:
    """The report's elastic policy: one cell at a time moves to training when (a) the rest of rollout can
    serve the unfinished executions and (b) ready groups have stayed above a fraction of the batch for a
    set time; cells come back when demand returns or the step's training is done. Beside the report's
    rules, the core trains a complete step without waiting for the water level where it is training
    already or the next batch waits for that step (`WaterLevelConfig.train_complete_steps`)."""

    config: WaterLevelConfig = field(default_factory=WaterLevelConfig)
    name: str = "elastic"
    admission: Admission = Admission.ROLLING
    moves_together: bool = False
    _above_since: float | None = None

    def demand(self, obs: Observation) -> tuple[float, float]:
        """(demand in rollout slots, predicted timeouts); the plain policy counts every execution."""
        return float(obs.unfinished), 0.0

    def decide(self, obs: Observation, cells: CellTable) -> list[Decision]:
        cfg = self.config
        threshold = max(1.0, cfg.ready_fraction * obs.batch_groups)
        if obs.trainable >= threshold:
            if self._above_since is None:
                self._above_since = obs.now
        else:
            self._above_since = None
        held = 0.0 if self._above_since is None else obs.now - self._above_since
        if cells.switching >= cells.config.max_concurrent_switches:
            return []
        demand, pred = self.demand(obs)
        core = cells.core
        sats = [c for c in cells.cells.values() if not c.is_core and c.role is Role.TRAINING]
        core_training = core is not None and core.role is Role.TRAINING
        cap = cells.rollout_capacity

        def back(cell_id: int, rule: str, c_cap: int) -> list[Decision]:
            w = _why(obs, cells, cap + c_cap, held, pred)
            return [Decision(obs.now, cell_id, Action.TO_ROLLOUT, rule, w)]

        # 1. Demand returned: the rollout cells cannot serve the unfinished executions.
        if demand > cfg.return_above * cap:
            if sats:
                s = min(sats, key=lambda c: (obs.trainable > 0, c.cell_id))
                return back(s.cell_id, "demand returned", s.capacity)
            idle = obs.trainable == 0 and not obs.updating
            keep = obs.step_ready and cfg.train_complete_steps
            if core_training and core is not None and (not obs.step_open or idle) and not keep:
                return back(core.cell_id, "demand returned", core.capacity)
        # 2. Training done: nothing left to claim.
        if obs.trainable == 0 and sats:
            s = sats[0]
            return back(s.cell_id, "no ready groups left to claim", s.capacity)
        if (
            core_training
            and core is not None
            and not sats
            and not obs.step_open
            and obs.trainable < threshold
        ):
            return back(core.cell_id, "step done, next batch not ready", core.capacity)
        if core is None or core.role is Role.FAILED:
            return []
        # 3. The core trains a complete step that the next batch waits for, whatever the water level.
        if core.role is Role.ROLLOUT and obs.step_unblocks and cfg.train_complete_steps:
            return [
                Decision(
                    obs.now,
                    core.cell_id,
                    Action.TO_TRAINING,
                    "the next batch waits for a complete step",
                    _why(obs, cells, cap - core.capacity, held, pred),
                )
            ]
        # 4. Move one rollout cell to training: (a) and (b).
        if held < cfg.hold_s or obs.trainable < threshold:
            return []
        if core.role is Role.ROLLOUT:
            cand = core
        elif core_training:
            free = [c for c in cells.cells.values() if c.role is Role.ROLLOUT and not c.is_core]
            if not free:
                return []
            cand = min(free, key=lambda c: c.cell_id)
        else:
            return []  # the core is mid-switch; satellites wait for it
        after = cap - cand.capacity
        if after < cfg.headroom * demand:
            return []
        return [
            Decision(
                obs.now,
                cand.cell_id,
                Action.TO_TRAINING,
                "water level low and ready groups held",
                _why(obs, cells, after, held, pred),
                protects=int(min(after, cfg.headroom * demand + 0.999999)),
            )
        ]


@dataclass(slots=True)
class PredictivePolicy(WaterLevelPolicy):
    """The water-level policy counting executions predicted to end at the timeout as a fraction of a
    slot: they end at the timeout whatever service they get, so a cell can leave earlier."""

    model: DurationModel | None = None
    predict: PredictConfig = field(default_factory=PredictConfig)
    name: str = "predictive"

    def demand(self, obs: Observation) -> tuple[float, float]:
        if self.model is None:
            return float(obs.unfinished), 0.0
        pred = self.model.predicted_timeouts(obs.ages, obs.age_counts)
        return obs.unfinished - (1.0 - self.predict.timeout_weight) * pred, pred


def _whole_pool(obs: Observation, cells: CellTable) -> list[Decision]:
    """The whole-pool switches of both Colocate variants: all of rollout to training when the oldest
    untrained batch is complete (freezing anything else that runs), all back once the next batch is not
    complete and the update is done. Whole batches only: partial batches are never trained."""
    if cells.n(*SWITCHING):
        return []
    rollout = sorted(cells.in_role(Role.ROLLOUT), key=lambda c: (not c.is_core, c.cell_id))
    training = sorted(cells.in_role(Role.TRAINING), key=lambda c: (c.is_core, c.cell_id))
    if not training and rollout and obs.batch_complete:
        why = _why(obs, cells, 0, 0.0)
        rule = "batch complete: whole pool trains"
        return [Decision(obs.now, c.cell_id, Action.TO_TRAINING, rule, why) for c in rollout]
    if training and not rollout and not obs.updating and not obs.batch_complete:
        why = _why(obs, cells, sum(c.capacity for c in cells.cells.values()), 0.0)
        rule = "step applied, next batch incomplete: whole pool rolls out"
        return [Decision(obs.now, c.cell_id, Action.TO_ROLLOUT, rule, why) for c in training]
    return []


@dataclass(slots=True)
class ColocatePolicy:
    """The report's Colocate: whole-pool switches and COHORT admission (module docstring)."""

    name: str = "colocate"
    admission: Admission = Admission.COHORT
    moves_together: bool = True

    def decide(self, obs: Observation, cells: CellTable) -> list[Decision]:
        return _whole_pool(obs, cells)


@dataclass(slots=True)
class RunAheadColocatePolicy:
    """Colocate's whole-pool switches with ROLLING admission: later batches roll out under a batch's
    tail. Not the report's Colocate (module docstring); kept to show what that overlap hides."""

    name: str = "colocate-runahead"
    admission: Admission = Admission.ROLLING
    moves_together: bool = True

    def decide(self, obs: Observation, cells: CellTable) -> list[Decision]:
        return _whole_pool(obs, cells)


@dataclass(slots=True)
class AsyncPolicy:
    """A fixed split: `train_cells` cells (the core first) train for the whole run, the rest roll out."""

    train_cells: int = 1
    name: str = "async"
    admission: Admission = Admission.ROLLING
    moves_together: bool = True

    def decide(self, obs: Observation, cells: CellTable) -> list[Decision]:
        """Fill the training side up to `train_cells` (at start, and again after a failure)."""
        if cells.switching >= cells.config.max_concurrent_switches:
            return []
        core = cells.core
        if core is None or core.role is Role.FAILED:
            return []
        if cells.n(Role.TO_TRAINING, Role.TRAINING, Role.DRAINING) >= self.train_cells:
            return []
        if core.role is Role.ROLLOUT:
            cand = core
        elif core.role is Role.TRAINING:
            idle = [c for c in cells.cells.values() if c.role is Role.ROLLOUT and not c.is_core]
            if not idle:
                return []
            cand = min(idle, key=lambda c: c.cell_id)
        else:
            return []
        why = _why(obs, cells, cells.rollout_capacity - cand.capacity, 0.0)
        return [Decision(obs.now, cand.cell_id, Action.TO_TRAINING, "fixed split", why)]
