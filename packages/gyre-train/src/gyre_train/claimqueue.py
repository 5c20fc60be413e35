"""The claim queue: the state the core's training thread shares with its server thread and its feeders.

It holds the mini-batches submitted ahead (`offer`, in queue order, into a bounded inbox), the one step
in progress (`begin` ... `finish`: its micro-batches as wire frames, who claimed and delivered which, the
in-order gradient sum of `claims.StepState`) and the trainer's position (step, weight version, snapshot,
queue position) that assignments and status replies carry. Every method is thread-safe (one condition
variable); any replica, the core included, claims and delivers through the same calls, and a caller
never holds a reference into the queue's state.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gyre_traj.pack import PackedBatch

from gyre_train.claims import StepState
from gyre_train.protocol import ArraySpec, Refusal
from gyre_train.wire import microbatch_arrays, to_frames


@dataclass(frozen=True)
class Position:
    """Where the trainer is: updates applied, weight version, its snapshot, mini-batches taken."""

    step: int = 0
    version: int = 0
    snapshot: int = 0
    queue_position: int = 0


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
    """What a finished step leaves: the in-order gradient sum and who computed what."""

    batch: int
    microbatches: int
    gradient: torch.Tensor
    metrics: dict[int, dict[str, float]]
    """Per micro-batch index, the metrics its replica reported."""
    done: dict[int, str]
    """Micro-batch index -> replica whose gradient was accepted."""
    requeued: int


class ClaimQueue:
    def __init__(
        self,
        numel: int,
        device: torch.device,
        check: Callable[[Sequence[PackedBatch]], None],
        inbox: int,
    ) -> None:
        """`numel`: flat gradient length; `device`: where the sum is kept; `check`: raises
        `MicroBatchError` for an untrainable mini-batch (run on every offer, outside the lock); `inbox`:
        mini-batches that may wait ahead of training."""
        self._numel = numel
        self._device = device
        self._check = check
        self._inbox_size = inbox
        self._cv = threading.Condition()
        self._inbox: deque[list[PackedBatch]] = deque()
        self._next_seq = 0
        self._pos = Position()
        self._batch_seq = 0
        self._state: StepState | None = None
        self._microbatches: list[PackedBatch] = []
        self._frames: list[tuple[tuple[ArraySpec, ...], list[Any]]] = []
        self._metrics: dict[int, dict[str, float]] = {}
        self._snapshot_of_step = 0

    # ---- the trainer's position ----------------------------------------------------------------------

    def position(self) -> Position:
        with self._cv:
            return self._pos

    def published(self, snapshot: int) -> None:
        """The current weights are now also snapshot `snapshot` (a republish)."""
        with self._cv:
            self._pos = Position(self._pos.step, self._pos.version, snapshot, self._pos.queue_position)

    def state_dict(self) -> dict[str, int]:
        """The position a checkpoint keeps (the snapshot number is this process's own)."""
        p = self.position()
        return {"step": p.step, "version": p.version, "queue_position": p.queue_position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at a checkpoint's position; refused while a step is in progress or mini-batches wait."""
        with self._cv:
            if self._state is not None or self._inbox:
                raise RuntimeError("load a position between steps, with nothing queued")
            self._pos = Position(
                int(state["step"]), int(state["version"]), self._pos.snapshot, int(state["queue_position"])
            )
            self._next_seq = self._pos.queue_position

    # ---- feeders -------------------------------------------------------------------------------------

    def offer(self, seq: int, microbatches: list[PackedBatch]) -> tuple[Refusal, str]:
        """Queue mini-batch `seq` (an empty one too: it is skipped when its turn comes). It must be the
        next queue position (a repeat or a gap is refused), fit the inbox and pass `check` (else
        MicroBatchError); a refusal says which and why, and queues nothing."""
        with self._cv:
            want = self._expected()
            if seq != want:
                return Refusal.OUT_OF_ORDER, f"mini-batch {seq} out of order: the core expects {want}"
            if len(self._inbox) >= self._inbox_size:
                return Refusal.INBOX_FULL, f"inbox full ({self._inbox_size} mini-batches): submit again later"
        self._check(microbatches)
        with self._cv:
            if self._expected() != want:
                return Refusal.OUT_OF_ORDER, f"mini-batch {seq} was offered twice at once"
            self._inbox.append(microbatches)
            self._next_seq = want + 1
            self._cv.notify_all()
        return Refusal.NONE, ""

    def _expected(self) -> int:
        # Positions already accepted (waiting, being trained or trained) are not offered again.
        return max(self._next_seq, self._pos.queue_position + (self._state is not None))

    def next_minibatch(self, timeout_s: float) -> list[PackedBatch] | None:
        """The oldest offered mini-batch, or None if none arrives within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while not self._inbox:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cv.wait(timeout=min(left, 0.1))
            return self._inbox.popleft()

    # ---- the training thread -------------------------------------------------------------------------

    def begin(self, microbatches: Sequence[PackedBatch]) -> int:
        """Make `microbatches` (checked, at least one) the step in progress at the current version;
        returns its batch id, unique for this queue's life (so no late gradient lands in a later step)."""
        frames = [to_frames(microbatch_arrays(b)) for b in microbatches]
        with self._cv:
            if self._state is not None:
                raise RuntimeError(f"mini-batch {self._state.batch} is still in progress")
            self._batch_seq += 1
            self._state = StepState(
                self._batch_seq, len(frames), self._numel, self._pos.version, device=self._device
            )
            self._microbatches = list(microbatches)
            self._frames = frames
            self._metrics = {}
            self._snapshot_of_step = self._pos.snapshot
            self._cv.notify_all()
            return self._batch_seq

    def wait_complete(self, timeout_s: float) -> bool:
        """True once every micro-batch of the step in progress is in; else waits up to `timeout_s` for a
        change (a delivery, a release) and returns False."""
        with self._cv:
            st = self._active()
            if st.complete:
                return True
            self._cv.wait(timeout=timeout_s)
            return st.complete

    def progress(self) -> tuple[int, int]:
        """(micro-batches done, micro-batches in all) of the step in progress."""
        with self._cv:
            st = self._active()
            return len(st.done), st.n

    def finish(self) -> StepResult:
        """End the complete step in progress; the caller applies its gradient and then `applied`."""
        with self._cv:
            st = self._active()
            res = StepResult(st.batch, st.n, st.gradient(), dict(self._metrics), dict(st.done), st.requeued)
            self._end()
            return res

    def abort(self) -> None:
        """Drop the step in progress unapplied (late gradients for it are refused)."""
        with self._cv:
            self._end()

    def _end(self) -> None:
        self._state = None
        self._microbatches = []
        self._frames = []
        self._metrics = {}
        self._cv.notify_all()

    def _active(self) -> StepState:
        if self._state is None:
            raise RuntimeError("no step in progress")
        return self._state

    def applied(self, snapshot: int) -> Position:
        """One update was applied and published as `snapshot`: step, version and queue position advance."""
        with self._cv:
            p = self._pos
            self._pos = Position(p.step + 1, p.version + 1, snapshot, p.queue_position + 1)
            return self._pos

    def skipped(self) -> Position:
        """A mini-batch with nothing to train took its queue position with no update."""
        with self._cv:
            p = self._pos
            self._pos = Position(p.step, p.version, p.snapshot, p.queue_position + 1)
            return self._pos

    @property
    def in_progress(self) -> bool:
        with self._cv:
            return self._state is not None

    # ---- every replica (the core's training thread and the server thread) -----------------------------

    def claim(self, replica: str) -> Assignment | None:
        """The next unclaimed micro-batch of the step in progress for `replica`, or None."""
        with self._cv:
            st = self._state
            if st is None:
                return None
            i = st.claim(replica)
            if i is None:
                return None
            specs, frames = self._frames[i]
            mb = self._microbatches[i]
            return Assignment(st.batch, i, st.version, self._snapshot_of_step, mb, specs, frames)

    def deliver(
        self,
        replica: str,
        batch: int,
        index: int,
        version: int,
        grad: np.ndarray | torch.Tensor,
        metrics: dict[str, float] | None = None,
    ) -> tuple[bool, str]:
        """Hand in `replica`'s float32 gradient of micro-batch `index` (copied before returning).
        (False, why) for a gradient of another step or version, or a duplicate; ClaimError for one the
        replica does not hold or of the wrong shape."""
        with self._cv:
            st = self._state
            if st is None or st.batch != batch:
                return False, f"mini-batch {batch} is not in progress"
            if version != st.version:
                return False, f"gradient at version {version}, the step is at {st.version}"
            ok = st.deliver(replica, index, grad)
            if ok:
                self._metrics[index] = dict(metrics or {})
            self._cv.notify_all()
            return ok, "" if ok else f"micro-batch {index} already done"

    def release(self, replica: str, indices: list[int] | None = None) -> int:
        """Put `replica`'s claims (all, or `indices`) back at the front of the queue; returns how many."""
        with self._cv:
            st = self._state
            n = 0 if st is None else st.release(replica, indices)
            self._cv.notify_all()
            return n

    def pending(self) -> int:
        """Micro-batches of the step in progress that nobody has claimed (0 between steps)."""
        with self._cv:
            return 0 if self._state is None else len(self._state.pending)
