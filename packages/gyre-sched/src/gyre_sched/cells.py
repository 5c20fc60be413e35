"""The cell table: every cell's role, and the role state machine with its invariants.

`CellTable.transition` is the only way a role changes; it checks, before changing anything, that the edge
exists, that the core trains whenever anyone trains, that no more than `max_concurrent_switches` cells are
mid-switch, and that a cell leaving rollout leaves enough capacity for the demand the caller protects.
A refused transition raises `InvariantError` and leaves the table as it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gyre_sched.protocol import CellView, Role

TRANSITIONS: dict[Role, frozenset[Role]] = {
    Role.ROLLOUT: frozenset({Role.DRAINING, Role.FAILED}),
    Role.DRAINING: frozenset({Role.TO_TRAINING, Role.ROLLOUT, Role.FAILED}),
    Role.TO_TRAINING: frozenset({Role.TRAINING, Role.TO_ROLLOUT, Role.FAILED}),
    Role.TRAINING: frozenset({Role.TO_ROLLOUT, Role.FAILED}),
    Role.TO_ROLLOUT: frozenset({Role.ROLLOUT, Role.FAILED}),
    Role.FAILED: frozenset({Role.ROLLOUT}),  # only by registering again
}
SWITCHING = frozenset({Role.DRAINING, Role.TO_TRAINING, Role.TO_ROLLOUT})
TRAINING_SIDE = frozenset({Role.TO_TRAINING, Role.TRAINING})


class InvariantError(RuntimeError):
    """A transition that would break the state machine; the table is unchanged."""


@dataclass(slots=True)
class Cell:
    cell_id: int
    is_core: bool
    capacity: int
    role: Role = Role.ROLLOUT
    since: float = 0.0

    def view(self) -> CellView:
        return CellView(self.cell_id, self.is_core, self.role, self.capacity, self.since)


@dataclass(frozen=True, slots=True)
class TableConfig:
    max_concurrent_switches: int = 1
    """How many cells may be draining or switching at once (the report moves cells one at a time)."""
    check_capacity: bool = True
    """Refuse a rollout cell leaving when the remaining capacity cannot serve the protected demand."""


@dataclass(slots=True)
class CellTable:
    """Cells by id, with per-role counts and rollout capacity kept up to date on every transition."""

    config: TableConfig = field(default_factory=TableConfig)
    cells: dict[int, Cell] = field(default_factory=dict)
    core_id: int | None = None
    counts: dict[Role, int] = field(default_factory=lambda: dict.fromkeys(Role, 0))
    rollout_capacity: int = 0

    # ---- membership --------------------------------------------------------------------------------
    def add(self, cell_id: int, *, is_core: bool, capacity: int, now: float = 0.0) -> Cell:
        """Register a cell (new, or a failed one coming back) in ROLLOUT."""
        if capacity < 0:
            raise InvariantError(f"cell {cell_id}: capacity must be >= 0, got {capacity}")
        old = self.cells.get(cell_id)
        if old is not None and old.role is not Role.FAILED:
            raise InvariantError(f"cell {cell_id} is already registered as {old.role.name}")
        if is_core and self.core_id is not None and self.core_id != cell_id:
            core = self.cells[self.core_id]
            if core.role is not Role.FAILED:
                raise InvariantError(f"cell {cell_id} claims core but cell {self.core_id} is the core")
            core.is_core = False
        if old is not None:
            self.counts[Role.FAILED] -= 1
        cell = Cell(cell_id, is_core, capacity, Role.ROLLOUT, now)
        self.cells[cell_id] = cell
        self.counts[Role.ROLLOUT] += 1
        self.rollout_capacity += capacity
        if is_core:
            self.core_id = cell_id
        return cell

    @property
    def core(self) -> Cell | None:
        return None if self.core_id is None else self.cells[self.core_id]

    def in_role(self, *roles: Role) -> list[Cell]:
        return [c for c in self.cells.values() if c.role in roles]

    def n(self, *roles: Role) -> int:
        return sum(self.counts[r] for r in roles)

    @property
    def switching(self) -> int:
        return self.n(*SWITCHING)

    # ---- the state machine ---------------------------------------------------------------------------
    def check_transition(self, cell_id: int, to: Role, *, protects: int = 0, forced: bool = False) -> None:
        """Raise InvariantError if `cell_id -> to` is not allowed now; change nothing."""
        cell = self.cells.get(cell_id)
        if cell is None:
            raise InvariantError(f"unknown cell {cell_id}")
        frm = cell.role
        if to not in TRANSITIONS[frm]:
            raise InvariantError(f"cell {cell_id}: no edge {frm.name} -> {to.name}")
        if to is Role.FAILED or forced:
            return
        if to is Role.ROLLOUT and frm is Role.FAILED:
            raise InvariantError(f"cell {cell_id}: a failed cell comes back only by registering again")
        starts_switch = frm in (Role.ROLLOUT, Role.TRAINING) and to in SWITCHING
        if starts_switch and self.switching >= self.config.max_concurrent_switches:
            raise InvariantError(
                f"cell {cell_id}: {self.switching} cell(s) already switching "
                f"(max_concurrent_switches={self.config.max_concurrent_switches})"
            )
        core = self.core
        if to in TRAINING_SIDE and not cell.is_core:
            if core is None or core.role not in TRAINING_SIDE:
                raise InvariantError(f"satellite {cell_id} cannot train: the core is not training")
            if to is Role.TRAINING and core.role is not Role.TRAINING:
                raise InvariantError(f"satellite {cell_id} cannot train before the core does")
        if cell.is_core and frm in TRAINING_SIDE and to is Role.TO_ROLLOUT:
            busy = [c.cell_id for c in self.cells.values() if not c.is_core and c.role in TRAINING_SIDE]
            if busy:
                raise InvariantError(f"the core cannot leave training while satellites {busy} train")
        if frm is Role.ROLLOUT and to is Role.DRAINING and self.config.check_capacity:
            left = self.rollout_capacity - cell.capacity
            if left < protects:
                raise InvariantError(
                    f"cell {cell_id}: leaving would cut rollout capacity to {left} "
                    f"below the {protects} unfinished executions it must serve"
                )

    def transition(
        self, cell_id: int, to: Role, now: float, *, protects: int = 0, forced: bool = False
    ) -> None:
        """Move `cell_id` to `to` after `check_transition`; `forced` skips the policy invariants (used
        only to recall satellites whose core failed)."""
        self.check_transition(cell_id, to, protects=protects, forced=forced)
        cell = self.cells[cell_id]
        self.counts[cell.role] -= 1
        self.counts[to] += 1
        if cell.role is Role.ROLLOUT:
            self.rollout_capacity -= cell.capacity
        if to is Role.ROLLOUT:
            self.rollout_capacity += cell.capacity
        cell.role = to
        cell.since = now

    def fail(self, cell_id: int, now: float) -> list[int]:
        """Mark a cell failed. If it was the core, every satellite on the training side is recalled to
        TO_ROLLOUT at once (no one may train without the core); returns the ids recalled."""
        cell = self.cells[cell_id]
        if cell.role is Role.FAILED:
            return []
        self.transition(cell_id, Role.FAILED, now)
        recalled: list[int] = []
        if cell.is_core:
            for other in self.cells.values():
                if other.role in TRAINING_SIDE:
                    self.transition(other.cell_id, Role.TO_ROLLOUT, now, forced=True)
                    recalled.append(other.cell_id)
        return recalled

    def check(self) -> None:
        """Check the global invariants; raise InvariantError naming the first one broken."""
        counts = dict.fromkeys(Role, 0)
        cap = 0
        for c in self.cells.values():
            counts[c.role] += 1
            cap += c.capacity if c.role is Role.ROLLOUT else 0
        if counts != self.counts or cap != self.rollout_capacity:
            raise InvariantError("role counts or rollout capacity out of date")
        core = self.core
        sat_training = any(c.role is Role.TRAINING and not c.is_core for c in self.cells.values())
        if sat_training and (core is None or core.role is not Role.TRAINING):
            raise InvariantError("a satellite trains while the core does not")
        if sum(1 for c in self.cells.values() if c.is_core) > 1:
            raise InvariantError("more than one core")

    def views(self) -> tuple[CellView, ...]:
        return tuple(c.view() for c in sorted(self.cells.values(), key=lambda c: c.cell_id))
