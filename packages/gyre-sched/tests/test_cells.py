"""The role state machine: legal edges only, and the invariants hold after any sequence of attempts."""

from __future__ import annotations

import pytest
from gyre_sched.cells import TRAINING_SIDE, CellTable, InvariantError, TableConfig
from gyre_sched.protocol import Role
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule


def table(n: int = 4, cap: int = 10, switches: int = 1) -> CellTable:
    t = CellTable(TableConfig(max_concurrent_switches=switches))
    for i in range(n):
        t.add(i, is_core=(i == 0), capacity=cap)
    return t


def to_training(t: CellTable, cid: int) -> None:
    for role in (Role.DRAINING, Role.TO_TRAINING, Role.TRAINING):
        t.transition(cid, role, 0.0)


def test_satellite_cannot_train_before_core() -> None:
    t = table()
    t.transition(1, Role.DRAINING, 0.0)
    with pytest.raises(InvariantError, match="core is not training"):
        t.transition(1, Role.TO_TRAINING, 0.0)
    assert t.cells[1].role is Role.DRAINING  # unchanged


def test_core_cannot_leave_while_satellites_train() -> None:
    t = table()
    to_training(t, 0)
    to_training(t, 1)
    with pytest.raises(InvariantError, match="satellites"):
        t.transition(0, Role.TO_ROLLOUT, 0.0)


def test_one_switch_at_a_time() -> None:
    t = table()
    t.transition(0, Role.DRAINING, 0.0)
    with pytest.raises(InvariantError, match="already switching"):
        t.transition(1, Role.DRAINING, 0.0)


def test_capacity_protected() -> None:
    t = table(cap=10)
    with pytest.raises(InvariantError, match="below the 35"):
        t.transition(0, Role.DRAINING, 0.0, protects=35)
    t.transition(0, Role.DRAINING, 0.0, protects=30)
    assert t.rollout_capacity == 30


def test_illegal_edge_and_unknown_cell() -> None:
    t = table()
    with pytest.raises(InvariantError, match="no edge ROLLOUT -> TRAINING"):
        t.transition(0, Role.TRAINING, 0.0)
    with pytest.raises(InvariantError, match="unknown cell"):
        t.transition(9, Role.DRAINING, 0.0)


def test_core_failure_recalls_satellites() -> None:
    t = table(switches=4)
    to_training(t, 0)
    to_training(t, 1)
    assert t.fail(0, 1.0) == [1]
    assert t.cells[1].role is Role.TO_ROLLOUT
    t.check()


def test_failed_cell_reregisters() -> None:
    t = table()
    t.fail(2, 0.0)
    assert t.rollout_capacity == 30
    with pytest.raises(InvariantError, match="registering again"):
        t.transition(2, Role.ROLLOUT, 0.0)
    t.add(2, is_core=False, capacity=10)
    assert t.rollout_capacity == 40
    with pytest.raises(InvariantError, match="already registered"):
        t.add(2, is_core=False, capacity=10)


class TableMachine(RuleBasedStateMachine):
    """Random transition attempts: each either applies or raises and changes nothing; invariants hold."""

    def __init__(self) -> None:
        super().__init__()
        self.t = table(n=5, cap=8, switches=2)

    @rule(cid=st.integers(0, 4), to=st.sampled_from(list(Role)), protects=st.integers(0, 40))
    def attempt(self, cid: int, to: Role, protects: int) -> None:
        before = self.t.views()
        try:
            if to is Role.FAILED:
                self.t.fail(cid, 0.0)
            else:
                self.t.transition(cid, to, 0.0, protects=protects)
        except InvariantError:
            assert self.t.views() == before
            return
        if to is Role.DRAINING:
            assert self.t.rollout_capacity >= protects

    @rule(cid=st.integers(0, 4))
    def reregister(self, cid: int) -> None:
        if self.t.cells[cid].role is Role.FAILED:
            self.t.add(cid, is_core=(cid == 0), capacity=8)

    @invariant()
    def consistent(self) -> None:
        self.t.check()
        core = self.t.core
        if any(c.role is Role.TRAINING for c in self.t.cells.values()):
            assert core is not None and core.role is Role.TRAINING
        assert self.t.switching <= 2 or any(c.role is Role.FAILED for c in self.t.cells.values())
        sats = [c for c in self.t.cells.values() if not c.is_core and c.role in TRAINING_SIDE]
        if sats:
            assert core is not None and core.role in TRAINING_SIDE


TestTable = TableMachine.TestCase
