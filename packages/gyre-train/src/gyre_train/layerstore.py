"""Every decoder layer's input hidden states over a whole tree ([layers, tokens, hidden_size], model dtype),
the checkpoints that layer-major tree training (`layered.py`) recomputes each layer from. Kept either on
the device or in page-locked host memory; on the host, copies run on a side CUDA stream (device -> host as
each layer's input is produced, host -> device one layer ahead of the backward sweep), each timed with
CUDA events on that stream, and the compute stream waits only on the copy it needs.
"""

from __future__ import annotations

import weakref

import torch

from gyre_train.hostmem import pin, unpin


class LayerStore:
    """`put(layer, h)` keeps a copy of `h` ([tokens, hidden_size] on the compute device) as `layer`'s input;
    `get(layer)` returns it on the compute device (started early by `prefetch(layer)`). With `host`, the
    copy lives in host memory (page-locked when CUDA is there) and only the layers being copied or used
    occupy the device."""

    def __init__(
        self, layers: int, tokens: int, hidden: int, dtype: torch.dtype, device: torch.device, host: bool
    ) -> None:
        self.layers, self.tokens, self.hidden = layers, tokens, hidden
        self.device, self.host = device, host
        self.cuda = device.type == "cuda"
        shape = (layers, tokens, hidden)
        if host:  # page-locked in place at its exact size (torch's pinned allocator rounds up to 2^k)
            self.store = torch.empty(shape, dtype=dtype)
            if self.cuda and pin(self.store):
                weakref.finalize(self, unpin, self.store)
        else:
            self.store = torch.empty(shape, dtype=dtype, device=device)
        self.stream = torch.cuda.Stream(device) if host and self.cuda else None
        self._timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._staged: dict[int, tuple[torch.Tensor, torch.cuda.Event | None]] = {}
        self.copies = 0

    def reset(self) -> None:
        """Forget the copy timings, counts and staged layers of an earlier step (the store is reused)."""
        self._timings.clear()
        self._staged.clear()
        self.copies = 0

    @property
    def host_bytes(self) -> int:
        return self.store.numel() * self.store.element_size() if self.host else 0

    def _check(self, layer: int) -> None:
        if not 0 <= layer < self.layers:
            raise IndexError(f"layer {layer} outside 0..{self.layers - 1}")

    def put(self, layer: int, h: torch.Tensor) -> None:
        """Keep `h` as `layer`'s input. The caller may free `h` afterwards (the copy holds it until done)."""
        self._check(layer)
        if h.shape != (self.tokens, self.hidden):
            raise ValueError(f"layer input shape {tuple(h.shape)} != {(self.tokens, self.hidden)}")
        if self.stream is None:
            self.store[layer].copy_(h)
            self.copies += int(self.host)
            return
        ready = torch.cuda.Event()
        ready.record()
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            self._timed(lambda: self.store[layer].copy_(h, non_blocking=True))
        h.record_stream(self.stream)
        self.copies += 1

    def prefetch(self, layer: int) -> None:
        """Start bringing `layer`'s input to the device (a no-op when kept there, or already started)."""
        self._check(layer)
        if not self.host or layer in self._staged:
            return
        if self.stream is None:
            self._staged[layer] = (self.store[layer].to(self.device, copy=True), None)
            self.copies += 1
            return
        out = torch.empty((self.tokens, self.hidden), dtype=self.store.dtype, device=self.device)
        done = torch.cuda.Event()
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # `out`'s allocation
            self._timed(lambda: out.copy_(self.store[layer], non_blocking=True))
            done.record()
        self._staged[layer] = (out, done)
        self.copies += 1

    def get(self, layer: int) -> torch.Tensor:
        """`layer`'s input on the compute device (the store's own tensor when kept there)."""
        self._check(layer)
        if not self.host:
            return self.store[layer]
        self.prefetch(layer)
        out, done = self._staged.pop(layer)
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)
            out.record_stream(torch.cuda.current_stream(self.device))
        return out

    def _timed(self, copy: object) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        copy()  # type: ignore[operator]
        end.record()
        self._timings.append((start, end))

    def transfer_seconds(self) -> float:
        """Time the copy stream spent copying (CUDA events on it); 0 without CUDA or without the host."""
        if not self._timings:
            return 0.0
        self._timings[-1][1].synchronize()
        return sum(s.elapsed_time(e) for s, e in self._timings) / 1000.0
