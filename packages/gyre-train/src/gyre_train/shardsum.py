"""One rank's gradient sum for the step training: its shard of every micro-batch's gradient, added in
micro-batch index order whatever order they arrive in.

The rule that makes the sum independent of who computed what: every micro-batch gradient is rounded to
the wire dtype once (a float32 gradient handed in here is rounded exactly as a sender rounds the one it
puts on the wire; with the float32 wire dtype nothing is rounded), then added into a float32 sum in index
order (a gradient that arrives early waits, in the wire dtype, for its turn). So the sum is the same
floats whichever replica computed which micro-batch and in which order they arrived; with the float32
wire dtype it is the single-replica sum. Each index is taken once per step (a second arrival, from a
replica presumed dead that was only slow, is dropped). Thread-safe; the sum lives on `device` (float32
additions are correctly rounded on a CPU and a GPU alike, so where it is kept does not change its bits).
"""

from __future__ import annotations

import threading

import numpy as np
import torch


class ShardSum:
    def __init__(self, numel: int, device: torch.device, wire: torch.dtype = torch.float32) -> None:
        self.numel = numel
        self.device = device
        self.wire = wire
        self._lock = threading.Lock()
        self._batch = -1
        self._closed = False
        self._acc: torch.Tensor | None = None
        self._next = 0
        self._seen: set[int] = set()
        self._waiting: dict[int, torch.Tensor] = {}

    def _start(self, batch: int) -> None:
        self._batch, self._closed = batch, False
        self._acc, self._next = None, 0
        self._seen, self._waiting = set(), {}

    def add(self, batch: int, index: int, grad: torch.Tensor | np.ndarray) -> bool:
        """Take micro-batch `index`'s gradient of step `batch` (float32 or the wire dtype, any device;
        copied before returning, so the caller may reuse its buffer). False, and nothing changes, for a
        step that is over or an index taken already. A newer `batch` starts a new sum."""
        t = (
            torch.from_numpy(grad if grad.flags.writeable else grad.copy())
            if isinstance(grad, np.ndarray)
            else grad
        )
        if tuple(t.shape) != (self.numel,):
            raise ValueError(f"gradient shard has shape {tuple(t.shape)}, expected ({self.numel},)")
        if t.dtype not in (torch.float32, self.wire):
            raise ValueError(f"gradient shard is {t.dtype}: expected float32 or {self.wire}")
        if index < 0:
            raise ValueError(f"micro-batch index {index} < 0")
        with self._lock:
            if batch > self._batch:
                self._start(batch)
            if batch != self._batch or self._closed or index in self._seen:
                return False
            self._seen.add(index)
            g = t.to(self.wire) if t.dtype != self.wire else t  # the one rounding (none for float32)
            if index != self._next:  # waits for its turn: keep a copy
                self._waiting[index] = g.to(self.device, copy=True)
                return True
            self._accumulate(g)
            while self._next in self._waiting:
                self._accumulate(self._waiting.pop(self._next))
            return True

    def _accumulate(self, g: torch.Tensor) -> None:
        if self._acc is None:
            self._acc = g.to(self.device, torch.float32, copy=True)
        else:  # a bf16 gradient is widened (exactly) inside the float32 addition, no temporary
            self._acc.add_(g.to(self.device))
        self._next += 1

    def total(self, batch: int, n: int) -> torch.Tensor | None:
        """The in-order sum of step `batch`'s `n` micro-batches (None for a step of none); it takes no
        more gradients afterwards. RuntimeError unless exactly indices 0..n-1 are in."""
        with self._lock:
            if n == 0:
                self._start(batch)
                self._closed = True
                return None
            if batch != self._batch or self._next != n or self._waiting:
                have = self._next if batch == self._batch else 0
                raise RuntimeError(f"step {batch}: {have} of {n} gradient shards summed in order")
            self._closed = True
            assert self._acc is not None
            return self._acc
