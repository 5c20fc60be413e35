"""The claims of one step: which micro-batches wait, which replica holds which, which are done.

A step may be open: micro-batches are appended (`add`) while it trains, and `close` fixes their number;
it is complete once closed with every gradient in. Micro-batches are claimed one at a time by any replica;
a replica that dies or leaves returns its claims to the front of the queue. This is bookkeeping only: the
gradients themselves are summed, in micro-batch order, by each rank's `shardsum.ShardSum`. Not
thread-safe: `claimqueue.ClaimQueue` guards it with its lock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


class ClaimError(ValueError):
    """A gradient for a micro-batch that this replica does not hold."""


@dataclass
class StepState:
    batch: int
    """Mini-batch id, unique for the core process's life (assignments and gradients carry it)."""
    n: int
    """Micro-batches so far (the final count once closed)."""
    version: int
    pending: deque[int] = field(default_factory=deque)
    claimed: dict[int, str] = field(default_factory=dict)
    done: dict[int, str] = field(default_factory=dict)
    """index -> replica whose gradient was accepted."""
    requeued: int = 0
    closed: bool = True
    """No micro-batch will be added (a closed step of none is complete at once, with no gradient)."""

    def __post_init__(self) -> None:
        if self.n < 0:
            raise ValueError(f"a step cannot have {self.n} micro-batches")
        self.pending.extend(range(self.n))

    def add(self, k: int) -> None:
        """Append `k` micro-batches (indices n .. n+k-1) to an open step, behind every pending one."""
        if self.closed:
            raise ClaimError(f"mini-batch {self.batch} is closed")
        self.pending.extend(range(self.n, self.n + k))
        self.n += k

    def close(self) -> None:
        """No more micro-batches: the step is complete once the `n` it has are in."""
        self.closed = True

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

    def acceptable(self, replica: str, index: int) -> bool:
        """May `replica` hand in micro-batch `index` now? False for a duplicate of a finished micro-batch
        (a replica declared dead that was only slow); ClaimError for one it never claimed."""
        if not 0 <= index < self.n:
            raise ClaimError(f"micro-batch {index} is not in mini-batch {self.batch} (0..{self.n - 1})")
        if index in self.done:
            return False
        if self.claimed.get(index) != replica and index not in self.pending:
            # (still pending: re-queued after this replica was presumed dead, and still valid)
            raise ClaimError(f"micro-batch {index} is held by {self.claimed.get(index)!r}, not {replica!r}")
        return True

    def deliver(self, replica: str, index: int) -> bool:
        """`replica`'s gradient of `index` is in every rank's sum: mark it done (see `acceptable`)."""
        if not self.acceptable(replica, index):
            return False
        if self.claimed.get(index) != replica:
            self.pending.remove(index)
        self.claimed.pop(index, None)
        self.done[index] = replica
        return True

    @property
    def complete(self) -> bool:
        return self.closed and len(self.done) == self.n
