"""Policies: the water-level rules (a) and (b), returns, baselines, and the duration model."""

from __future__ import annotations

from gyre_sched.cells import CellTable, TableConfig
from gyre_sched.policy import (
    AsyncPolicy,
    ColocatePolicy,
    Observation,
    RunAheadColocatePolicy,
    WaterLevelConfig,
    WaterLevelPolicy,
    batches_to_start,
)
from gyre_sched.predict import DurationModel, PredictConfig
from gyre_sched.protocol import Action, Admission, Role
from hypothesis import given
from hypothesis import strategies as st


def table(n: int = 4, cap: int = 10, switches: int = 1) -> CellTable:
    t = CellTable(TableConfig(max_concurrent_switches=switches))
    for i in range(n):
        t.add(i, is_core=(i == 0), capacity=cap)
    return t


def obs(now: float, unfinished: int, trainable: int, **kw: object) -> Observation:
    return Observation(now=now, unfinished=unfinished, trainable=trainable, batch_groups=16, **kw)  # type: ignore[arg-type]


def test_water_level_needs_both_conditions_and_the_hold() -> None:
    t = table()
    p = WaterLevelPolicy(WaterLevelConfig(ready_fraction=0.25, hold_s=60.0))
    assert p.decide(obs(0, 20, 4), t) == []  # (b) just started holding
    assert p.decide(obs(59, 20, 4), t) == []
    [d] = p.decide(obs(61, 20, 4), t)
    assert (d.cell_id, d.action) == (0, Action.TO_TRAINING)  # the core goes first
    assert d.why.capacity_after == 30 and d.why.unfinished == 20 and d.why.held_s >= 60
    assert d.protects == 20
    # (a) fails: the other three cells could not serve 35 executions.
    p2 = WaterLevelPolicy(WaterLevelConfig(hold_s=0.0))
    assert p2.decide(obs(0, 35, 8), table()) == []
    # (b) fails: 3 ready < 4 = 25% of 16.
    assert p2.decide(obs(0, 5, 3), table()) == []


def test_hold_resets_when_ready_groups_drop() -> None:
    p = WaterLevelPolicy(WaterLevelConfig(hold_s=60.0))
    t = table()
    p.decide(obs(0, 5, 8), t)
    p.decide(obs(30, 5, 1), t)
    assert p.decide(obs(70, 5, 8), t) == []


def _train(t: CellTable, cid: int) -> None:
    for role in (Role.DRAINING, Role.TO_TRAINING, Role.TRAINING):
        t.transition(cid, role, 0.0)


def test_returns_on_demand_and_when_done() -> None:
    p = WaterLevelPolicy(WaterLevelConfig(hold_s=0.0))
    t = table()
    _train(t, 0)
    _train(t, 1)
    [d] = p.decide(obs(0, 25, 5, step_open=True), t)  # 25 > 20 capacity: the satellite returns
    assert (d.cell_id, d.action, d.rule) == (1, Action.TO_ROLLOUT, "demand returned")
    t.transition(1, Role.TO_ROLLOUT, 0.0)
    t.transition(1, Role.ROLLOUT, 0.0)
    assert p.decide(obs(0, 25, 5, step_open=True), t) == []  # the core keeps its open step
    [d] = p.decide(obs(0, 5, 0, step_open=False), t)
    assert (d.cell_id, d.action) == (0, Action.TO_ROLLOUT)


def test_a_complete_step_is_trained_without_waiting_for_the_water_level() -> None:
    """A complete step (its batch complete, not all trained): a training core stays for it when demand
    returns, as for a step it has opened; and where the driver holds a batch back until that step is
    applied, a rollout core goes to train it at once, whatever the water level. The satellites follow
    the water level as before. With the step's batch incomplete, or with the rule off, the report's rules
    alone decide."""
    p = WaterLevelPolicy(WaterLevelConfig(hold_s=60.0))
    t = table()
    held = {"batch_complete": True, "admission_held": True}
    # 35 executions against 40 slots: (a) fails for any cell, and (b) has not held for 60 s
    assert p.decide(obs(0, 35, 16), t) == []
    [d] = p.decide(obs(0, 35, 16, **held), t)
    assert (d.cell_id, d.action, d.rule) == (
        0,
        Action.TO_TRAINING,
        "the next batch waits for a complete step",
    )
    assert d.why.capacity_after == 30 and d.why.unfinished == 35
    assert p.decide(obs(0, 35, 16, batch_complete=False, admission_held=True), t) == []
    assert p.decide(obs(0, 35, 0, **held), t) == []  # nothing left to train: the step is applied
    off = WaterLevelPolicy(WaterLevelConfig(hold_s=60.0, train_complete_steps=False))
    assert off.decide(obs(0, 35, 16, **held), t) == []
    # both trained the step before, and a new batch of demand came: the satellite returns ...
    _train(t, 0)
    _train(t, 1)
    [d] = p.decide(obs(0, 35, 16, **held), t)
    assert (d.cell_id, d.action, d.rule) == (1, Action.TO_ROLLOUT, "demand returned")
    t.transition(1, Role.TO_ROLLOUT, 0.0)
    t.transition(1, Role.ROLLOUT, 0.0)
    # ... and the core stays for the complete step though it has not opened it yet (held back or not)
    assert p.decide(obs(0, 35, 16, **held), t) == []
    assert p.decide(obs(0, 35, 16, batch_complete=True), t) == []
    [d] = off.decide(obs(0, 35, 16, **held), t)
    assert (d.cell_id, d.action, d.rule) == (0, Action.TO_ROLLOUT, "demand returned")
    [d] = p.decide(obs(0, 35, 4, admission_held=True), t)  # its batch incomplete: the report's rule
    assert (d.cell_id, d.action, d.rule) == (0, Action.TO_ROLLOUT, "demand returned")


def test_satellites_follow_the_core_one_at_a_time() -> None:
    p = WaterLevelPolicy(WaterLevelConfig(hold_s=0.0))
    t = table()
    t.transition(0, Role.DRAINING, 0.0)
    assert p.decide(obs(0, 0, 16), t) == []  # a switch is in progress
    t.transition(0, Role.TO_TRAINING, 0.0)
    t.transition(0, Role.TRAINING, 0.0)
    [d] = p.decide(obs(0, 0, 16), t)
    assert d.cell_id == 1


def test_colocate_switches_whole_pool() -> None:
    t = table(switches=4)
    p = ColocatePolicy()
    assert p.decide(obs(0, 50, 10, batch_complete=False), t) == []
    ds = p.decide(obs(0, 50, 16, batch_complete=True), t)
    assert [d.cell_id for d in ds] == [0, 1, 2, 3] and all(d.action is Action.TO_TRAINING for d in ds)


def test_colocate_trains_whole_batches_and_returns_when_the_next_is_incomplete() -> None:
    """Both Colocate variants make the same whole-pool switches; they differ only in admission."""
    for p in (ColocatePolicy(), RunAheadColocatePolicy()):
        t = table(switches=4)
        for cid in range(4):
            _train(t, cid)
        # Updating, or the next step's batch already complete: the pool keeps training.
        assert p.decide(obs(0, 30, 16, batch_complete=True, step_open=True), t) == []
        assert p.decide(obs(0, 30, 0, updating=True), t) == []
        # The next batch is incomplete (even with some of its groups ready): the whole pool rolls out.
        ds = p.decide(obs(0, 30, 5, batch_complete=False), t)
        assert sorted(d.cell_id for d in ds) == [0, 1, 2, 3]
        assert all(d.action is Action.TO_ROLLOUT for d in ds)
    assert ColocatePolicy().admission is Admission.COHORT
    assert RunAheadColocatePolicy().admission is Admission.ROLLING
    assert ColocatePolicy().moves_together and not WaterLevelPolicy().moves_together


@given(st.integers(0, 50), st.integers(0, 50), st.integers(0, 5))
def test_batches_to_start(started: int, behind: int, max_ahead: int) -> None:
    trained = max(0, started - behind)
    rolling = batches_to_start(Admission.ROLLING, started=started, trained=trained, max_ahead=max_ahead)
    cohort = batches_to_start(Admission.COHORT, started=started, trained=trained, max_ahead=max_ahead)
    assert rolling == max(0, trained + max_ahead + 1 - started)  # batch b starts once b <= trained + ahead
    assert cohort == (max_ahead + 1 if trained == started else 0)  # a whole cohort, only when all trained
    assert cohort <= rolling


def test_async_fixed_split() -> None:
    t = table(switches=4)
    p = AsyncPolicy(train_cells=2)
    [d] = p.decide(obs(0, 0, 0), t)
    assert d.cell_id == 0
    _train(t, 0)
    [d] = p.decide(obs(0, 0, 0), t)
    assert d.cell_id == 1
    _train(t, 1)
    assert p.decide(obs(0, 0, 0), t) == []


def test_duration_model() -> None:
    m = DurationModel(100.0, PredictConfig(bins=10, min_samples=10))
    assert m.p_timeout(50) == 0.0  # too few samples
    for d in range(10, 60, 5):
        m.observe(float(d), False)
    for _ in range(10):
        m.observe(100.0, True)
    assert m.p_timeout(0) == 0.5
    assert m.p_timeout(70) == 1.0
    assert m.predicted_timeouts((0.0, 70.0), (4, 6)) == 6
