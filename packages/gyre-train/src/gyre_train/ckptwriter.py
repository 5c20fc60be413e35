"""Checkpoints written in the background: the training thread takes a host copy of the trainer's state and
goes on to its next step while another thread writes the copy (`checkpoint.save`: a temporary directory
renamed into place, so the previous checkpoint stays whole until the new one is).

Saved in line by the training thread after every step, a checkpoint of the Qwen3-0.6B shape (the
weights and AdamW's two moments) held the next step back by 4.3-5.4 s on the H200 host. The host copy
is device-to-host copies only; the serialization, the write and its fsync overlap the next step.

One write at a time: `submit` first waits for the write before it, so at most one host copy is held and
checkpoints land in step order. A checkpoint that lags the last applied step is what a crash during a
synchronous save leaves too: a resumed run trains the steps after it again from their batches. A write
that fails ends the process loudly by default (`threads.start_thread`), as a training thread's failure does: a
trainer that silently stopped checkpointing would lose every step since on the next restart. A caller
with its own way to end (a full disk said as such) passes `on_error`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from gyre_train import checkpoint
from gyre_train.checkpoint import OptimizerState, TrainerState
from gyre_train.threads import start_thread

WRITER = "checkpoint-writer"
"""The writer thread's name (in its log lines and in the message of a process it ends)."""


def host_copy(state: TrainerState) -> TrainerState:
    """`state` with every tensor copied to host memory (a copy even where it already is there: the
    trainer updates its tensors in place)."""

    def copy(t: torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(t).detach().to("cpu", copy=True)

    return TrainerState(
        model={n: copy(t) for n, t in state["model"].items()},
        optimizer=OptimizerState(
            state={n: {k: copy(v) for k, v in st.items()} for n, st in state["optimizer"]["state"].items()},
            param_groups=[dict(g) for g in state["optimizer"]["param_groups"]],
        ),
        position=dict(state["position"]),
        layout=state["layout"],
        model_config=dict(state["model_config"]),
    )


class CheckpointWriter:
    """Writes trainer states to checkpoint directories on a background thread (see the module)."""

    def __init__(self, on_error: Callable[[BaseException], None] | None = None) -> None:
        self.on_error = on_error
        """Called on the writer's thread with a write's exception (the handler then owns the failure: it
        says so, or ends the process); if it raises, the process ends (`threads.start_thread`). None: the
        process ends at once."""
        self._thread: threading.Thread | None = None
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
        snap, dest = host_copy(state), Path(path)
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
