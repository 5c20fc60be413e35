"""The claims of one step and its order-fixed gradient sum.

A step may be open: micro-batches are appended (`add`) while it trains, and `close` fixes their number;
it is complete once closed with every gradient in. Micro-batches are claimed one at a time by any replica; a replica that dies or leaves returns its claims
to the front of the queue. Gradients are added in micro-batch index order whatever order they arrive in
(later ones wait in a reorder buffer), so the sum is the same float for float whichever replicas
computed which micro-batches. The sum lives on the core's device (float32 additions are correctly
rounded on a CPU and a GPU alike, so the bits do not depend on where it is kept); every accepted gradient
is copied there before `deliver` returns, so the sender may reuse its buffer at once. Not thread-safe:
`claimqueue.ClaimQueue` guards it with its lock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch


class ClaimError(ValueError):
    """A gradient for a micro-batch that this replica does not hold, or of the wrong size."""


@dataclass
class StepState:
    batch: int
    """Mini-batch id, unique for the core process's life (assignments and gradients carry it)."""
    n: int
    """Micro-batches so far (the final count once closed)."""
    numel: int
    version: int
    pending: deque[int] = field(default_factory=deque)
    claimed: dict[int, str] = field(default_factory=dict)
    done: dict[int, str] = field(default_factory=dict)
    """index -> replica whose gradient was accepted."""
    requeued: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where the sum (and gradients waiting for their turn) are kept."""
    closed: bool = True
    """No micro-batch will be added (a closed step of none is complete at once, with no gradient)."""
    _acc: torch.Tensor | None = None
    _next: int = 0
    _waiting: dict[int, torch.Tensor] = field(default_factory=dict)

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

    def deliver(self, replica: str, index: int, grad: np.ndarray | torch.Tensor) -> bool:
        """Accept `replica`'s float32 gradient for `index` (copied before returning). False for a
        duplicate of a finished micro-batch (a replica declared dead that was only slow); ClaimError for
        one it never claimed."""
        if not 0 <= index < self.n:
            raise ClaimError(f"micro-batch {index} is not in mini-batch {self.batch} (0..{self.n - 1})")
        if tuple(grad.shape) != (self.numel,):
            raise ClaimError(f"gradient has shape {tuple(grad.shape)}, expected ({self.numel},)")
        if grad.dtype not in (np.float32, torch.float32):
            raise ClaimError(f"gradient has dtype {grad.dtype}, expected float32")
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
        if isinstance(grad, np.ndarray):  # a read-only buffer is copied here rather than wrapped
            t = torch.from_numpy(grad if grad.flags.writeable else grad.copy())
        else:
            t = grad
        if index != self._next:  # waits for its turn: keep a copy
            self._waiting[index] = t.to(self.device, copy=True)
            return True
        if self._acc is None:
            self._acc = t.to(self.device, copy=True)
        else:
            self._acc += t.to(self.device, non_blocking=False)
        self._next += 1
        while self._next in self._waiting:
            self._acc += self._waiting.pop(self._next)
            self._next += 1
        return True

    @property
    def complete(self) -> bool:
        return self.closed and self._next == self.n

    def gradient(self) -> torch.Tensor:
        """The in-order sum of the complete step's gradients (a step of no micro-batch has none)."""
        if not self.complete or self._acc is None:
            raise RuntimeError(f"mini-batch {self.batch}: {len(self.done)} of {self.n} micro-batches done")
        return self._acc
