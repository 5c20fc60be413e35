"""The claim queue: the state the core's training thread shares with its server thread and its feeders.

It holds the steps accepted and not yet applied, in queue order, each open (`open`, then `add` any number
of times) or closed (`close` with its final micro-batch and execution counts; `submit` does all three at
once). Only the oldest step trains: the training thread `begin`s it, and from then on the core and every
admitted satellite `claim` its micro-batches as they arrive and `deliver` them once their gradients are in
every rank's `ShardSum` (`acceptable` says beforehand whether a replica's gradient is still wanted); it
is complete once closed with every gradient in, and `finish` hands back what the update needs (the
micro-batches, the execution count, who computed what). The queue also owns the trainer's position
(step, weight version, snapshot, queue position) that assignments and status replies carry. Every
method is thread-safe (one condition variable); a caller never holds a reference into its state.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gyre_traj.pack import PackedBatch

from gyre_train.claims import StepState
from gyre_train.protocol import ArraySpec, Refusal, StepInfo
from gyre_train.wire import microbatch_arrays, to_frames

Verdict = tuple[Refusal, str]
"""(Refusal.NONE, "") when accepted; else which refusal and why (nothing changed)."""
ACCEPTED: Verdict = (Refusal.NONE, "")


@dataclass(frozen=True)
class Position:
    """Where the trainer is: updates applied, weight version, its snapshot, steps taken."""

    step: int = 0
    version: int = 0
    snapshot: int = 0
    queue_position: int = 0
    """Steps trained or skipped: the next step to train has this number."""


@dataclass(frozen=True)
class QueuedStep:
    """A handle on an accepted step (what `next_step` returns and `Core.train_step` takes)."""

    seq: int


@dataclass(frozen=True)
class Assignment:
    """One claimed micro-batch: compute its gradient at weight `version` (gyre-xfer `snapshot`)."""

    batch: int
    index: int
    version: int
    snapshot: int
    microbatch: PackedBatch
    specs: tuple[ArraySpec, ...]
    frames: list[Any]
    """The micro-batch's arrays as wire frames (`specs` describe them), for a satellite."""


@dataclass(frozen=True)
class StepResult:
    """What a finished step leaves: its micro-batches, its execution count and who computed what (the
    gradient is in the ranks' `ShardSum`s)."""

    seq: int
    batch: int
    microbatches: list[PackedBatch]
    executions: int
    """What the in-order gradient sum is divided by."""
    metrics: dict[int, dict[str, float]]
    """Per micro-batch index, the metrics its replica reported."""
    done: dict[int, str]
    """Micro-batch index -> replica whose gradient was accepted."""
    requeued: int


@dataclass
class _Step:
    seq: int
    microbatches: list[PackedBatch] = field(default_factory=list)
    frames: list[tuple[tuple[ArraySpec, ...], list[Any]]] = field(default_factory=list)
    closed: bool = False
    executions: int = 1


def _frames(microbatches: Sequence[PackedBatch]) -> list[tuple[tuple[ArraySpec, ...], list[Any]]]:
    return [to_frames(microbatch_arrays(b)) for b in microbatches]


class ClaimQueue:
    def __init__(self, check: Callable[[Sequence[PackedBatch]], None], inbox: int) -> None:
        """`check`: raises `MicroBatchError` for untrainable micro-batches (run on every add, outside the
        lock); `inbox`: steps that may be accepted ahead of the one training (open or closed)."""
        self._check = check
        self._inbox = inbox
        self._cv = threading.Condition()
        self._steps: deque[_Step] = deque()
        """Accepted and not yet finished, oldest first; the oldest may be training (`_state`)."""
        self._state: StepState | None = None
        self._landing: _Step | None = None
        """The step `finish` handed to the training thread, until its update lands (`applied` or
        `skipped` move the queue position past it): still accepted and not applied, so it counts for
        the next step's turn and shows in `steps`."""
        self._snapshot_of_step = 0
        self._metrics: dict[int, dict[str, float]] = {}
        self._pos = Position()
        self._batch_seq = 0

    # ---- the trainer's position ----------------------------------------------------------------------

    def position(self) -> Position:
        with self._cv:
            return self._pos

    def published(self, snapshot: int) -> None:
        """The current weights are now also snapshot `snapshot` (a republish)."""
        with self._cv:
            p = self._pos
            self._pos = Position(p.step, p.version, snapshot, p.queue_position)

    def state_dict(self) -> dict[str, int]:
        """The position a checkpoint keeps: the last applied update. Steps accepted and not yet applied
        (open, closed, or training) are not kept: the feeder gives them again from `queue_position`."""
        p = self.position()
        return {"step": p.step, "version": p.version, "queue_position": p.queue_position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at a checkpoint's position; refused while any step is accepted."""
        with self._cv:
            if self._steps or self._landing is not None:
                raise RuntimeError("load a position with no step accepted")
            self._pos = Position(
                int(state["step"]), int(state["version"]), self._pos.snapshot, int(state["queue_position"])
            )

    # ---- feeders -------------------------------------------------------------------------------------

    def open(self, seq: int) -> Verdict:
        """Accept step `seq` (the next queue position) open, with no micro-batch yet."""
        with self._cv:
            why = self._admissible(seq)
            if why[0] is Refusal.NONE:
                self._steps.append(_Step(seq))
                self._cv.notify_all()
            return why

    def add(self, seq: int, microbatches: Sequence[PackedBatch]) -> Verdict:
        """Append micro-batches to open step `seq` (claimable at once if it trains). MicroBatchError if
        any fails the checks (none is added)."""
        with self._cv:
            if self._open_step(seq) is None:
                return self._not_open(seq)
        self._check(microbatches)
        frames = _frames(microbatches)
        with self._cv:
            st = self._open_step(seq)
            if st is None:
                return self._not_open(seq)
            st.microbatches += microbatches
            st.frames += frames
            if self._state is not None and st is self._steps[0]:
                self._state.add(len(microbatches))
            self._cv.notify_all()
            return ACCEPTED

    def close(self, seq: int, microbatches: int, executions: int = 1) -> Verdict:
        """Close open step `seq`: `microbatches` must be the number it was given; its summed gradient
        will be divided by `executions` (>= 1)."""
        with self._cv:
            st = self._open_step(seq)
            if st is None:
                return self._not_open(seq)
            if microbatches != len(st.microbatches):
                return (
                    Refusal.COUNT_MISMATCH,
                    f"step {seq} was given {len(st.microbatches)} micro-batches, not {microbatches}",
                )
            if executions < 1:
                return Refusal.MALFORMED, f"step {seq}: executions must be >= 1, got {executions}"
            st.closed, st.executions = True, executions
            if self._state is not None and st is self._steps[0]:
                self._state.close()
            self._cv.notify_all()
            return ACCEPTED

    def submit(self, seq: int, microbatches: Sequence[PackedBatch], executions: int = 1) -> Verdict:
        """`open`, `add` and `close` in one: all or nothing (an empty step is skipped in its turn)."""
        if executions < 1:
            return Refusal.MALFORMED, f"step {seq}: executions must be >= 1, got {executions}"
        with self._cv:
            why = self._admissible(seq)
            if why[0] is not Refusal.NONE:
                return why
        self._check(microbatches)
        frames = _frames(microbatches)
        with self._cv:
            why = self._admissible(seq)
            if why[0] is Refusal.NONE:
                self._steps.append(_Step(seq, list(microbatches), frames, True, executions))
                self._cv.notify_all()
            return why

    def _admissible(self, seq: int) -> Verdict:
        want = self._pos.queue_position + (self._landing is not None) + len(self._steps)
        if seq != want:
            return Refusal.OUT_OF_ORDER, f"step {seq} out of order: the core expects {want}"
        if len(self._steps) - (self._state is not None) >= self._inbox:
            return Refusal.INBOX_FULL, f"inbox full ({self._inbox} steps waiting): submit again later"
        return ACCEPTED

    def _open_step(self, seq: int) -> _Step | None:
        return next((st for st in self._steps if st.seq == seq and not st.closed), None)

    def _not_open(self, seq: int) -> Verdict:
        landing = self._landing is not None and self._landing.seq == seq
        closed = landing or any(st.seq == seq for st in self._steps) or seq < self._pos.queue_position
        return Refusal.NOT_OPEN, f"step {seq} is {'closed' if closed else 'not open'}"

    def steps(self) -> tuple[StepInfo, ...]:
        """Every accepted step not yet applied, oldest first: what it holds and how far it is (a step whose
        update is landing shows as training with every gradient in)."""
        with self._cv:
            landing = self._landing
            first = () if landing is None else (self._landed_info(landing),)
            return first + tuple(self._info(st) for st in self._steps)

    @staticmethod
    def _landed_info(st: _Step) -> StepInfo:
        n = len(st.microbatches)
        return StepInfo(st.seq, True, True, n, 0, 0, n, st.executions)

    def _info(self, st: _Step) -> StepInfo:
        n = len(st.microbatches)
        state = self._state if st is self._steps[0] else None
        if state is None:
            return StepInfo(st.seq, st.closed, False, n, n, 0, 0, st.executions)
        q, c, d = len(state.pending), len(state.claimed), len(state.done)
        return StepInfo(st.seq, st.closed, True, n, q, c, d, st.executions)

    # ---- the training thread -------------------------------------------------------------------------

    def next_step(self, timeout_s: float) -> QueuedStep | None:
        """The oldest accepted step not training yet (open or closed), or None if none is accepted
        within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while not self._steps or self._state is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cv.wait(timeout=min(left, 0.1))
            return QueuedStep(self._steps[0].seq)

    def begin(self, step: QueuedStep) -> int:
        """Start training `step` (the oldest accepted) at the current version: its micro-batches, and
        every one added later, may be claimed. Returns its batch id, unique for this queue's life (so no
        late gradient lands in a later step)."""
        with self._cv:
            if self._state is not None:
                raise RuntimeError(f"step {self._steps[0].seq} is training already")
            if not self._steps or self._steps[0].seq != step.seq:
                raise RuntimeError(f"step {step.seq} is not the oldest accepted step")
            head = self._steps[0]
            self._batch_seq += 1
            self._state = StepState(
                self._batch_seq, len(head.microbatches), self._pos.version, closed=head.closed
            )
            self._snapshot_of_step = self._pos.snapshot
            self._metrics = {}
            self._cv.notify_all()
            return self._batch_seq

    def begin_local(self, microbatches: Sequence[PackedBatch], executions: int = 1) -> int:
        """Accept `microbatches` (checked already) as the next step, closed, and start training it; for a
        core without feeders (RuntimeError if any step is accepted)."""
        frames = _frames(microbatches)
        with self._cv:
            if self._steps:
                raise RuntimeError("steps from feeders are accepted: train those (next_step) first")
            seq = self._pos.queue_position
            self._steps.append(_Step(seq, list(microbatches), frames, True, executions))
        return self.begin(QueuedStep(seq))

    def wait_complete(self, timeout_s: float) -> bool:
        """True once the step training is closed with every gradient in; else waits up to `timeout_s`
        for a change (a delivery, an add, a close, a release) and returns False."""
        with self._cv:
            st = self._training()
            if st.complete:
                return True
            self._cv.wait(timeout=timeout_s)
            return st.complete

    def progress(self) -> StepInfo:
        """How far the step training is."""
        with self._cv:
            self._training()
            return self._info(self._steps[0])

    def finish(self) -> StepResult:
        """End the complete step training; the caller applies its gradient, then `applied` (or
        `skipped` for a step of no micro-batch)."""
        with self._cv:
            st = self._training()
            if not st.complete:
                raise RuntimeError(f"mini-batch {st.batch}: {len(st.done)} of {st.n} micro-batches done")
            head = self._steps.popleft()
            self._landing = head
            res = StepResult(
                head.seq,
                st.batch,
                head.microbatches,
                head.executions,
                dict(self._metrics),
                dict(st.done),
                st.requeued,
            )
            self._state = None
            self._metrics = {}
            self._cv.notify_all()
            return res

    def abort(self) -> None:
        """Stop training the step unapplied: its claims are void (late gradients are refused) and it
        stays the oldest accepted step, to be begun again from scratch."""
        with self._cv:
            self._state = None
            self._metrics = {}
            self._cv.notify_all()

    def _training(self) -> StepState:
        if self._state is None:
            raise RuntimeError("no step is training")
        return self._state

    def applied(self, snapshot: int) -> Position:
        """One update was applied and published as `snapshot`: step, version and queue position advance."""
        with self._cv:
            p = self._pos
            self._pos = Position(p.step + 1, p.version + 1, snapshot, p.queue_position + 1)
            self._landing = None
            self._cv.notify_all()
            return self._pos

    def dropped(self) -> None:
        """The finished step was not applied and is forgotten (`Core.gradient`: a gradient computed to
        look at, not to train): step, version and queue position stay where they were."""
        with self._cv:
            self._landing = None
            self._cv.notify_all()

    def skipped(self) -> Position:
        """A step with nothing to train took its queue position with no update."""
        with self._cv:
            p = self._pos
            self._pos = Position(p.step, p.version, p.snapshot, p.queue_position + 1)
            self._landing = None
            self._cv.notify_all()
            return self._pos

    # ---- every replica (the core's training thread and the server thread) -----------------------------

    def claim(self, replica: str) -> Assignment | None:
        """The next unclaimed micro-batch of the step training, for `replica`, or None."""
        with self._cv:
            st = self._state
            if st is None:
                return None
            i = st.claim(replica)
            if i is None:
                return None
            head = self._steps[0]
            specs, frames = head.frames[i]
            return Assignment(
                st.batch, i, st.version, self._snapshot_of_step, head.microbatches[i], specs, frames
            )

    def acceptable(self, replica: str, batch: int, index: int, version: int) -> tuple[bool, str]:
        """Is `replica`'s gradient of micro-batch `index` still wanted (before its shards are read)?
        (False, why) for another step or version, or a duplicate; ClaimError for one it does not hold."""
        with self._cv:
            return self._acceptable(replica, batch, index, version)

    def _acceptable(self, replica: str, batch: int, index: int, version: int) -> tuple[bool, str]:
        st = self._state
        if st is None or st.batch != batch:
            return False, f"mini-batch {batch} is not in progress"
        if version != st.version:
            return False, f"gradient at version {version}, the step is at {st.version}"
        if not st.acceptable(replica, index):
            return False, f"micro-batch {index} already done"
        return True, ""

    def deliver(
        self, replica: str, batch: int, index: int, version: int, metrics: dict[str, float] | None = None
    ) -> tuple[bool, str]:
        """`replica`'s gradient of micro-batch `index` is in every rank's `ShardSum`: mark it done.
        (False, why) as `acceptable` says; ClaimError for one the replica does not hold."""
        with self._cv:
            ok, why = self._acceptable(replica, batch, index, version)
            if ok:
                assert self._state is not None
                self._state.deliver(replica, index)
                self._metrics[index] = dict(metrics or {})
            self._cv.notify_all()
            return ok, why

    def release(self, replica: str, indices: list[int] | None = None) -> int:
        """Put `replica`'s claims (all, or `indices`) back at the front of the queue; returns how many."""
        with self._cv:
            st = self._state
            n = 0 if st is None else st.release(replica, indices)
            self._cv.notify_all()
            return n

    def pending(self) -> int:
        """Micro-batches of the step training that nobody has claimed (0 when none trains)."""
        with self._cv:
            return 0 if self._state is None else len(self._state.pending)
