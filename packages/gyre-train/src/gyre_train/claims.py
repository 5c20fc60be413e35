"""The claim queue of one mini-batch and its order-fixed gradient sum.

Micro-batches are claimed one at a time by any replica; a replica that dies or leaves returns its claims
to the front of the queue. Gradients are added in micro-batch index order whatever order they arrive in
(later ones wait in a reorder buffer), so the sum is the same float for float whichever replicas
computed which micro-batches. Not thread-safe: the core guards it with its lock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np


class ClaimError(ValueError):
    """A gradient for a micro-batch that this replica does not hold, or of the wrong size."""


@dataclass
class StepState:
    batch: int
    """Mini-batch id, unique for the core process's life (assignments and gradients carry it)."""
    n: int
    numel: int
    version: int
    pending: deque[int] = field(default_factory=deque)
    claimed: dict[int, str] = field(default_factory=dict)
    done: dict[int, str] = field(default_factory=dict)
    """index -> replica whose gradient was accepted."""
    requeued: int = 0
    _acc: np.ndarray | None = None
    _next: int = 0
    _waiting: dict[int, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError("a mini-batch needs at least one micro-batch")
        self.pending.extend(range(self.n))

    def claim(self, replica: str) -> int | None:
        if not self.pending:
            return None
        i = self.pending.popleft()
        self.claimed[i] = replica
        return i

    def release(self, replica: str, indices: list[int] | None = None) -> int:
        """Return `replica`'s claims (all, or `indices`) to the front of the queue; returns how many."""
        mine = sorted(
            i for i, r in self.claimed.items() if r == replica and (indices is None or i in indices)
        )
        for i in reversed(mine):
            del self.claimed[i]
            self.pending.appendleft(i)
        self.requeued += len(mine)
        return len(mine)

    def deliver(self, replica: str, index: int, grad: np.ndarray) -> bool:
        """Accept `replica`'s gradient for `index`. False for a duplicate of a finished micro-batch
        (a replica declared dead that was only slow); ClaimError for one it never claimed."""
        if not 0 <= index < self.n:
            raise ClaimError(f"micro-batch {index} is not in mini-batch {self.batch} (0..{self.n - 1})")
        if grad.shape != (self.numel,):
            raise ClaimError(f"gradient has shape {grad.shape}, expected ({self.numel},)")
        if index in self.done:
            return False
        if self.claimed.get(index) != replica:
            if index in self.pending:  # re-queued after this replica was presumed dead: still valid
                self.pending.remove(index)
            else:
                raise ClaimError(
                    f"micro-batch {index} is held by {self.claimed.get(index)!r}, not {replica!r}"
                )
        self.claimed.pop(index, None)
        self.done[index] = replica
        self._waiting[index] = grad
        while self._next in self._waiting:
            g = self._waiting.pop(self._next)
            if self._acc is None:
                self._acc = np.array(g, dtype=np.float32, copy=True)
            else:
                self._acc += g
            self._next += 1
        return True

    @property
    def complete(self) -> bool:
        return self._next == self.n

    def gradient(self) -> np.ndarray:
        if not self.complete or self._acc is None:
            raise RuntimeError(f"mini-batch {self.batch}: {len(self.done)} of {self.n} micro-batches done")
        return self._acc
