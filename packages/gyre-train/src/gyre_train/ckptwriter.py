"""Checkpoints written in the background: the training thread takes a host copy of the trainer's state and
goes on to its next step while another thread writes the copy (`checkpoint.save`: a temporary directory
renamed into place, so the previous checkpoint stays whole until the new one is).

Saved in line by the training thread after every step, a checkpoint of the Qwen3-0.6B shape (the
weights and AdamW's two moments) held the next step back by 4.3-5.4 s on the H200 host. The host copy
is device-to-host copies only; the serialization, the write and its fsync overlap the next step.

The host copy lands in memory kept from one checkpoint to the next (`HostBuffers`): one flat buffer laid
out for the state's tensors, page-locked when they live on a GPU, so the copies run at the link's speed
and no page is faulted in again. Taken into fresh pageable tensors each time, the copy of that state held
the training thread for 0.8-2.9 s after every step on an H100 host; into the kept page-locked buffer,
0.07-0.08 s (the first 1.4-1.7 s, the buffer allocated and pinned).

One write at a time: `submit` first waits for the write before it, so the buffer is free again, at most
one host copy is held and checkpoints land in step order. A checkpoint that lags the last applied step
is what a crash during a synchronous save leaves too: a resumed run trains the steps after it again from
their batches. A write that fails ends the process loudly by default (`threads.start_thread`), as a
training thread's failure does: a trainer that silently stopped checkpointing would lose every step
since on the next restart. A caller with its own way to end (a full disk said as such) passes
`on_error`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from gyre_xfer.pinning import CudaHostPinning, PinningError

from gyre_train import checkpoint
from gyre_train.checkpoint import OptimizerState, TrainerState
from gyre_train.threads import start_thread

_log = logging.getLogger(__name__)

WRITER = "checkpoint-writer"
"""The writer thread's name (in its log lines and in the message of a process it ends)."""


_ALIGN = 64
"""Byte alignment of each tensor in the flat buffer (any dtype's view of it is aligned)."""


class HostBuffers:
    """Host memory for checkpoints' copies, kept from one to the next: one flat buffer with a view per
    tensor of the state, laid out again only when the tensors' names, shapes or dtypes change. When the
    state lives on a GPU the buffer is page-locked (gyre-xfer's `CudaHostPinning`, registered once), so
    the device-to-host copies are queued without waiting and the stream is synchronized once; a refused
    registration is a logged warning and the copies stay pageable (slower, the same bytes).

    A copy is valid until the next `copy` (the caller writes it before taking the next one) or `close`."""

    def __init__(self) -> None:
        self._layout: tuple[tuple[tuple[str, ...], tuple[int, ...], torch.dtype], ...] | None = None
        self._flat: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []
        self._pinned_by: CudaHostPinning | None = None
        self.layouts = 0
        """How many times a buffer was laid out (allocated, and pinned where it could be)."""

    @property
    def nbytes(self) -> int:
        """Bytes of the current buffer (0 before the first copy and after `close`)."""
        return 0 if self._flat is None else self._flat.numel()

    @property
    def pinned(self) -> bool:
        """Whether the current buffer is page-locked."""
        return self._pinned_by is not None

    def copy(self, state: TrainerState) -> TrainerState:
        """`state` with every tensor copied into this object's buffer (a copy even of tensors already on
        the host: the trainer updates its tensors in place), every copy landed when it returns."""
        items = [(key, torch.as_tensor(t).detach()) for key, t in _tensors(state)]
        layout = tuple((key, tuple(t.shape), t.dtype) for key, t in items)
        if layout != self._layout:
            self._lay_out(layout, next((t.device for _, t in items if t.is_cuda), None))
        devices: set[torch.device] = set()
        for (_, src), dst in zip(items, self._views, strict=True):
            dst.copy_(src, non_blocking=self.pinned and src.is_cuda)
            if src.is_cuda:
                devices.add(src.device)
        for d in devices:
            torch.cuda.current_stream(d).synchronize()
        views = {key: v for (key, _), v in zip(items, self._views, strict=True)}
        return TrainerState(
            model={n: views[("model", n)] for n in state["model"]},
            optimizer=OptimizerState(
                state={
                    n: {k: views[("optimizer", n, k)] for k in st}
                    for n, st in state["optimizer"]["state"].items()
                },
                param_groups=[dict(g) for g in state["optimizer"]["param_groups"]],
            ),
            position=dict(state["position"]),
            layout=state["layout"],
            model_config=dict(state["model_config"]),
        )

    def _lay_out(
        self,
        layout: tuple[tuple[tuple[str, ...], tuple[int, ...], torch.dtype], ...],
        device: torch.device | None,
    ) -> None:
        self.close()
        spans: list[tuple[int, int]] = []
        end = 0
        for _, shape, dtype in layout:
            nbytes = math.prod(shape) * dtype.itemsize
            spans.append((end, nbytes))
            end += -(-nbytes // _ALIGN) * _ALIGN
        flat = torch.empty(max(end, 1), dtype=torch.uint8)
        self._views = [
            flat[off : off + n].view(dtype).view(shape)
            for (off, n), (_, shape, dtype) in zip(spans, layout, strict=True)
        ]
        self._flat, self._layout = flat, layout
        self.layouts += 1
        if device is not None:
            try:
                pinning = CudaHostPinning(str(device))
                pinning.pin_range(flat.data_ptr(), flat.numel())
            except PinningError as e:
                _log.warning("checkpoint host copies stay pageable (slower): %s", e)
            else:
                self._pinned_by = pinning

    def close(self) -> None:
        """Unpin and drop the buffer (a copy taken from it must not be used after this)."""
        flat, pinning = self._flat, self._pinned_by
        self._flat, self._pinned_by, self._views, self._layout = None, None, [], None
        if flat is not None and pinning is not None:
            try:
                pinning.unpin_range(flat.data_ptr(), flat.numel())
            except PinningError as e:
                _log.warning("unpinning the checkpoint buffer failed: %s", e)


def _tensors(state: TrainerState) -> list[tuple[tuple[str, ...], torch.Tensor]]:
    """Every tensor of `state` with its key, in a fixed order (the model's, then the optimizer's)."""
    out: list[tuple[tuple[str, ...], torch.Tensor]] = [(("model", n), t) for n, t in state["model"].items()]
    for n, st in state["optimizer"]["state"].items():
        out.extend((("optimizer", n, k), v) for k, v in st.items())
    return out


class CheckpointWriter:
    """Writes trainer states to checkpoint directories on a background thread (see the module)."""

    def __init__(self, on_error: Callable[[BaseException], None] | None = None) -> None:
        self.on_error = on_error
        """Called on the writer's thread with a write's exception (the handler then owns the failure: it
        says so, or ends the process); if it raises, the process ends (`threads.start_thread`). None: the
        process ends at once."""
        self._thread: threading.Thread | None = None
        self.buffers = HostBuffers()
        """Where the host copies land (one at a time: `submit` waits for the write before)."""
        self.written = 0
        """Checkpoints written so far."""

    def submit(self, state: TrainerState, path: Path) -> tuple[float, float]:
        """Wait for the write before (if any), take a host copy of `state` and write it to `path` in the
        background. Returns once the copy is taken: the caller may update its tensors from then on.
        Returns the seconds it waited for the write before and the seconds the host copy took (what the
        caller's thread spent here)."""
        t0 = time.perf_counter()
        self.wait()
        t1 = time.perf_counter()
        snap, dest = self.buffers.copy(state), Path(path)
        self._thread = start_thread(lambda: self._write(snap, dest), WRITER)
        return t1 - t0, time.perf_counter() - t1

    def _write(self, state: TrainerState, path: Path) -> None:
        """On the writer's thread (`threads.start_thread`: an exception out of here ends the process)."""
        try:
            checkpoint.save(state, path)
        except BaseException as exc:
            if self.on_error is None:
                raise
            self.on_error(exc)
            return
        self.written += 1

    def wait(self, timeout_s: float | None = None) -> bool:
        """Until the write in flight (if any) is done; False if it still runs after `timeout_s`."""
        t = self._thread
        if t is None:
            return True
        t.join(timeout_s)
        if t.is_alive():
            return False
        self._thread = None
        return True

    def close(self, timeout_s: float | None = None) -> bool:
        """Wait for the write in flight, then give the host buffer back (unpinned). False, keeping the
        buffer, if the write still runs after `timeout_s`."""
        if not self.wait(timeout_s):
            return False
        self.buffers.close()
        return True
