"""One cell of a single-machine run (`gyre cell`): a gyre-engine server it owns, and a trainer replica.

The cell starts `gyre-engine serve` as its child and, while the engine loads, its trainer side (so the
core's addresses reach the other cells at once and their engines start beside this one, not after it);
then it registers with gyre-sched as a CELL whose endpoint is that engine. Cell 0 is the trainer core (gyre-train `Core`, its model built from the directory's whole HF
config, `ModelConfig.from_model_dir`, and loaded with its weights, as the engine serves them); the others
run a gyre-train `Satellite` that stays connected and idle until admitted. On a `SwitchCommand` to
TRAINING the cell releases its engine's memory and joins training (the core takes the oldest step, open or
whole, and computes its micro-batches as they arrive; a satellite is admitted through `CoreClient` and
claims at once what is queued); back to ROLLOUT it leaves training (the core stops computing micro-batches
but still aggregates and applies the step in progress, which the cells that train, or the core when it
returns, finish; a satellite is dismissed), resumes the engine, loads the newest weights and only then
answers `SwitchDone`. While in rollout, a weight thread follows the core's version and pulls each new
snapshot into the engine (gyre-xfer over shared memory). The core appends one JSON line per step to
`steps.jsonl` in the run directory. In rollout the core still takes a step closed with no micro-batch and
skips it (nothing to compute): no ready group counts for such a step, so no policy moves the cell to
training for it. The trainer thread and the satellite thread are gyre-train's `threads.start_thread`: if
one dies, the cell process ends at once (exit status 70, the traceback in its log), and `gyre run` ends
naming it (or restarts it: `supervise.py`). A cell whose trainer has more than one rank (`[cell] tensor_parallel`,
`pipeline_parallel`) is rank 0 of a gyre-train multi-rank cell and starts the other ranks as its
children before building its replica (`ranks.py`); a cell whose shape is not the core's runs no
replica (rollout only). A cell that cannot write for want of space (its steps line,
its checkpoint, `core.json`) exits with `procs.nospace.EXIT_DISK_FULL` instead, and the run stops once.

With `checkpoint` set, the core saves a gyre-train checkpoint there after each applied step (after its
`steps.jsonl` line: a host copy of its state taken by the training thread, written by gyre-train's
`CheckpointWriter` while the next step trains, one write at a time) and, when one is there at start,
resumes from it; every cell loads the core's
version into its engine before it registers, so a restarted or resumed cell never serves older weights
(a fresh one pulls the weights its engine holds, to set the pull path up before its first switch).
A cell the scheduler refuses at Hello (a restarted one whose old self is not yet failed) asks again
until `startup_timeout_s`; once welcomed it writes its pid to `cells/<id>.up` in the run directory.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import faulthandler
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import zmq
from gyre_sched.client import dealer
from gyre_sched.protocol import (
    CellLost,
    Codec,
    GetState,
    Heartbeat,
    Hello,
    PeerKind,
    Reject,
    Role,
    SwitchCommand,
    SwitchDone,
    Welcome,
)

from gyre.cell.args import CellArgs
from gyre.cell.sglang_cell import SGLangEngine
from gyre.procs import nospace
from gyre.procs.group import ProcessGroup, python_argv

if TYPE_CHECKING:
    from gyre_engine.protocol import XferWeightsReply
    from gyre_train.cell import Cell as TrainCell
    from gyre_train.claimqueue import QueuedStep
    from gyre_traj.loss import LossConfig

log = logging.getLogger("gyre.cell")
QUIET_S = 120.0
CHECKPOINT_WAIT_S = 60.0
"""How long a stopping cell waits for the checkpoint being written (a 0.6B model's takes seconds); the
process that stops it may kill it sooner (`gyre run`'s own children: 10 s after SIGTERM), which leaves the
checkpoint before whole."""
T = TypeVar("T")


class StoppedWhileStarting(Exception):
    """SIGTERM arrived while the cell's engine was still starting (the cell stops at once)."""


class Cell:
    def __init__(self, a: CellArgs) -> None:
        self.a = a
        self.run_dir = Path(a.run_dir)
        self.url = f"http://{a.host}:{a.engine_port}"
        self.name = f"cell-{a.cell_id}"
        self.procs = ProcessGroup(self.run_dir / "logs")
        self.stop = threading.Event()
        self.role = Role.ROLLOUT
        self.training = threading.Event()  # the trainer side may work (core: take steps and compute)
        self.engine_version = 0
        self.weights_lock = threading.Lock()  # one weight update or memory change at a time
        self.core: Any = None
        self.ckpt_writer: Any = None
        """The core's checkpoint writer (gyre-train `CheckpointWriter`), with `checkpoint` set."""
        self.client: Any = None  # CoreClient (weight thread + admit/dismiss)
        self.publisher = a.publisher
        self.fatal: BaseException | None = None
        self.sglang: SGLangEngine | None = None  # when [cell] engine = "sglang"
        self.rank_cell: TrainCell | None = None  # rank 0's view of a multi-rank trainer (`ranks.py`)
        self._engine_deadline = 0.0
        self._quiet_since = time.monotonic()
        """When this cell last switched or applied a step: a cell training longer than `QUIET_S` without
        either dumps every thread's stack into its log (diagnosis of a slow or stuck step)."""

    # ---- engine -------------------------------------------------------------------------------------
    def _engine(self, fn: Callable[[Any], Awaitable[T]], timeout_s: float = 120.0) -> T:
        from gyre_engine.client import EngineClient

        async def go() -> T:
            async with EngineClient(self.url, timeout_s=timeout_s) as c:
                return await fn(c)

        return asyncio.run(go())

    def launch_engine(self) -> None:
        """Start the engine's process (or SGLang's, which `SGLangEngine.start` waits for); `wait_engine`
        waits for it, so the trainer side starts while the engine loads (and the core's addresses reach
        the other cells, whose engines then start beside this one instead of after it)."""
        if self.a.engine == "sglang":
            self.sglang = SGLangEngine(self.a, self.procs)
            self.sglang.start()
            return
        argv = python_argv(
            "gyre_engine", "serve", "--model", self.a.model_dir, "--port", str(self.a.engine_port),
            "--device", self.a.device, *self.a.engine_argv, "--host", self.a.host,
            *(["--allow-remote"] if self.a.host != "127.0.0.1" else []),
        )  # fmt: skip
        self.procs.start(f"engine-{self.a.cell_id}", argv, env={"OMP_NUM_THREADS": "1"})
        self._engine_deadline = time.monotonic() + self.a.startup_timeout_s

    def wait_engine(self) -> None:
        """Until the launched engine answers its health check (SIGTERM meanwhile stops the cell). It is
        asked at least once, also when the trainer's start-up (its warm-up) took the whole time."""
        if self.sglang is not None:
            return
        while True:
            if self.stop.is_set():
                raise StoppedWhileStarting(f"cell {self.a.cell_id} stopped while its engine was starting")
            self.procs.check()
            with contextlib.suppress(Exception):
                if self._engine(lambda c: c.health(timeout=2.0), timeout_s=5.0):
                    return
            if time.monotonic() >= self._engine_deadline:
                break
            time.sleep(0.3)
        raise TimeoutError(f"engine of cell {self.a.cell_id} not healthy within {self.a.startup_timeout_s}s")

    def _startup_record(
        self, launched: float, trainer_ready: float, engine_ready: float, first_pull_s: float | None
    ) -> None:
        """`cells/<id>.startup.json` in the run directory: when the engine was launched, the trainer side
        was ready and the engine answered (wall times; `gyre run`'s metrics read them), and the seconds of
        the engine's first weight pull at start-up (None: SGLang's engine, which is pushed to)."""
        d = self.run_dir / "cells"
        d.mkdir(parents=True, exist_ok=True)
        rec = {"cell": self.a.cell_id, "engine_launched": launched, "trainer_ready": trainer_ready,
               "engine_ready": engine_ready, "first_pull_s": first_pull_s}  # fmt: skip
        tmp = d / f"{self.a.cell_id}.startup.json.tmp"
        tmp.write_text(json.dumps(rec))
        tmp.rename(d / f"{self.a.cell_id}.startup.json")

    def release_engine(self) -> None:
        """Free the engine for training; it must be idle (the proxy drained it), so retry a 409."""
        from gyre_engine.client import EngineError

        if not self.a.release_memory:
            return
        if self.sglang is not None:
            with self.weights_lock:
                self.sglang.release()
                self.engine_version = -1  # SGLang keeps no copy: the next sync sends the whole model
            return
        deadline = time.monotonic() + 30.0
        while True:
            try:
                with self.weights_lock:
                    self._engine(lambda c: c.release_memory(None))
                return
            except EngineError as exc:
                if exc.status != 409 or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def resume_engine(self) -> None:
        if self.a.release_memory:
            with self.weights_lock:
                if self.sglang is not None:
                    self.sglang.resume()
                else:
                    self._engine(lambda c: c.resume_memory(None))

    def sync_weights(self) -> bool:
        """Load the core's newest version into the engine if it is newer; True if it changed."""
        t_status = time.monotonic()
        st = self.client.status()
        if st.version <= self.engine_version:
            return False
        asked = time.time()
        status_s = time.monotonic() - t_status
        if self.sglang is not None:
            with self.weights_lock:
                push_s = self.sglang.load(self.publisher, st.snapshot, st.version)
            self.engine_version = st.version
            self._version_record(st.version, asked, status_s, push_s, None, None)
            log.info("cell %d: SGLang at version %d (%.3fs push)", self.a.cell_id, st.version, push_s)
            return True
        rep = self._pull(st.snapshot, st.version)
        if not rep.success:
            raise RuntimeError(f"cell {self.a.cell_id}: weight update failed: {rep.message}")
        self.engine_version = st.version
        self._version_record(st.version, asked, status_s, rep.pull_s, rep.apply_s, rep.apply_wait_s)
        log.info(
            "cell %d: engine at version %d (status %.3fs, pull %.3fs, apply %.3fs of which %.3fs waiting"
            " for the engine's step, %.3fs in all)",
            self.a.cell_id, st.version, status_s, rep.pull_s, rep.apply_s, rep.apply_wait_s,
            time.time() - asked + status_s,
        )  # fmt: skip
        return True

    def first_pull(self) -> float | None:
        """At start-up, before the cell registers: the core's newest version into the engine (a resumed
        core's, or the running core's on a restart), or, where the engine already holds it, the same
        weights pulled once anyway, so that the pull path is set up before the first switch to rollout
        (the subscriber's sockets, its staging buffer, page-locked on a GPU, and the shared memory's
        mapping: on the H200 a first pull of the 0.6B model took 1.4 s inside that switch, later ones
        0.3 s). Returns the pull's seconds; None for SGLang's engine (pushed to in `sync_weights`)."""
        if self.sglang is not None:
            self.sync_weights()
            return None
        t0 = time.monotonic()
        if not self.sync_weights():
            rep = self._pull(self.client.status().snapshot, self.engine_version)
            if not rep.success:
                raise RuntimeError(f"cell {self.a.cell_id}: first weight pull failed: {rep.message}")
            log.info("cell %d: first pull at start-up in %.3fs", self.a.cell_id, rep.pull_s)
        return round(time.monotonic() - t0, 4)

    def _pull(self, snapshot: int, version: int) -> XferWeightsReply:
        """The engine pulls the core's snapshot `snapshot` (or newer) and serves it as `version`."""
        with self.weights_lock:
            return self._engine(
                lambda c: c.update_weights_from_xfer(
                    self.publisher,
                    min_version=snapshot,
                    transport="shm",
                    weight_version=str(version),
                    layout="megatron" if self.a.model_backend == "megatron" else "transformers",
                )  # the core publishes its backend's one-rank layout; the engine converts Megatron's
            )

    def _version_record(
        self,
        version: int,
        asked: float,
        status_s: float,
        pull_s: float,
        apply_s: float | None,
        apply_wait_s: float | None,
    ) -> None:
        """A line of `cells/<id>.versions.jsonl` in the run directory: when this cell asked for `version`
        (the core's status reply in hand, after `status_s` waiting for it) and when its engine served it
        (wall times; `gyre run`'s metrics take each push's end from them, not from the sampler's
        interval), and the engine's own seconds pulling the snapshot and applying it between two steps,
        `apply_wait_s` of the latter waiting for the engine thread's step to end (None where the engine
        does not say: SGLang's push is one figure)."""
        d = self.run_dir / "cells"
        d.mkdir(parents=True, exist_ok=True)
        rec = {"cell": self.a.cell_id, "version": version, "asked": asked, "served": time.time(),
               "status_s": round(status_s, 4), "pull_s": round(pull_s, 4),
               "apply_s": None if apply_s is None else round(apply_s, 4),
               "apply_wait_s": None if apply_wait_s is None else round(apply_wait_s, 4)}  # fmt: skip
        with open(d / f"{self.a.cell_id}.versions.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")

    def weight_loop(self) -> None:
        while not self.stop.is_set():
            if self.role is Role.ROLLOUT:
                try:
                    self.sync_weights()
                except Exception as exc:  # the next round retries; a dead core ends the run elsewhere
                    log.warning("cell %d: weight sync failed: %s", self.a.cell_id, exc)
            self.stop.wait(0.05)  # a status request to the core: the push waits for this poll

    # ---- trainer ------------------------------------------------------------------------------------
    def start_trainer(self) -> None:
        from gyre_train.control import CoreClient
        from gyre_train.threads import start_thread

        if self.a.ranks > 1:  # a multi-rank cell: this process is rank 0, its children the others
            from gyre.cell.ranks import start_cell

            self.rank_cell = start_cell(self.a, self.procs)
            log.info("cell %d: %d trainer ranks joined (tp %d, pp %d)", self.a.cell_id, self.a.ranks,
                     self.a.tensor_parallel, self.a.pipeline_parallel)  # fmt: skip
        if self.a.is_core:
            self._start_core()
            self.client = CoreClient(self.core.address, timeout_s=30.0)
            start_thread(self.train_loop, "core-train")
            return
        if not self.a.core:  # started beside the core: its addresses come with its core.json
            self._await_core()
        self.client = CoreClient(self.a.core, timeout_s=30.0)
        if not self.a.trains:  # rollout only: the weight thread follows the core, nothing else
            return
        from gyre_train.satellite import Satellite, SatelliteConfig

        sat = Satellite(
            SatelliteConfig(
                core=self.a.core,
                name=self.name,
                device=self.a.device,
                reply_timeout_s=60.0,
                warmup=self._warmup(),
            ),
            self.rank_cell,
        )

        def serve() -> None:
            try:
                sat.run()
            except Exception:
                if self.stop.is_set():  # the run is ending: the core went first
                    return
                raise  # start_thread ends the cell, loudly

        start_thread(serve, "satellite")

    def _start_core(self) -> None:
        """The core replica (on rank 0 of a multi-rank cell), with the model directory's weights or the
        checkpoint's; its addresses go to `core.json` in the run directory."""
        from gyre_train.core import Core, CoreConfig, OptimConfig
        from gyre_train.model import Attention, build_model, load_pretrained, pretrained_weights
        from gyre_train.modelconfig import ModelConfig

        # the directory's whole HF config
        mc = ModelConfig.from_model_dir(self.a.model_dir, backend=self.a.model_backend)
        attention: Attention = "flex" if self.a.device == "cuda" else "dense"
        device = self.a.device if self.rank_cell is None else str(self.rank_cell.device(self.a.device))
        model = build_model(mc, attention, device)
        whole = mc.backend == "megatron"  # loaded through the core, into every rank's part
        if not whole:
            load_pretrained(model, mc, self.a.model_dir)
        cfg = CoreConfig(
            attention=attention,
            token_budget=self.a.token_budget,
            chunk_budget=self.a.chunk_budget,
            loss=loss_config(self.a),
            mismatch_warn=self.a.mismatch_warn,
            optim=OptimConfig(lr=self.a.lr),
            dead_after_s=30.0,
            bind=f"tcp://{self.a.host}:0",
            keep_batches=self.a.keep_batches,
        )
        self.core = Core(model, mc, cfg, self.rank_cell)
        if self.a.checkpoint:
            from gyre_train.ckptwriter import CheckpointWriter

            self.ckpt_writer = CheckpointWriter(on_error=self._checkpoint_failed)
        ckpt = Path(self.a.checkpoint) if self.a.checkpoint else None
        if ckpt is not None and (ckpt / "state.json").exists():
            self.core.load(ckpt)
            log.info("core resumed from %s at version %d", ckpt, self.core.version)
        elif whole:
            self.core.load_whole_weights(pretrained_weights(mc, self.a.model_dir))
        self.core.warm_up(self._warmup())  # the attention kernels compiled now, not in the first step
        self.core.set_computing(False)  # the cell starts in rollout
        self.publisher = self.core.publisher.address
        info = {"core": self.core.address, "publisher": self.publisher}
        tmp = self.run_dir / "core.json.tmp"
        tmp.write_text(json.dumps(info))
        tmp.rename(self.run_dir / "core.json")

    def _warmup(self) -> int:
        """Synthetic micro-batches the trainer replica computes at start (`[cell] warmup`)."""
        from gyre_train.defaults import warmup_rounds

        return self.a.warmup if self.a.warmup >= 0 else warmup_rounds(self.a.device)

    def _await_core(self) -> None:
        """A satellite started beside the core: wait for the core's `core.json` in the run directory and
        take its addresses (SIGTERM meanwhile stops the cell)."""
        path = self.run_dir / "core.json"
        deadline = time.monotonic() + self.a.startup_timeout_s
        while not path.exists():
            if self.stop.is_set():
                raise StoppedWhileStarting(f"cell {self.a.cell_id} stopped while waiting for the core")
            if time.monotonic() > deadline:
                raise TimeoutError(f"cell {self.a.cell_id}: no {path} within {self.a.startup_timeout_s} s")
            time.sleep(0.1)
        info = json.loads(path.read_text())
        self.a = dataclasses.replace(self.a, core=info["core"], publisher=info["publisher"])
        self.publisher = self.a.publisher

    def train_loop(self) -> None:
        """Core only: while in training, take the oldest step (open or whole) and train it to its update,
        which may outlast the cell's training role (see the module docstring). An error ends the cell
        (`start_thread`), unless the cell is already closing."""
        try:
            self._train_steps()
        except Exception as exc:
            if self.stop.is_set():
                return
            if nospace.is_full(exc) is not None:  # the steps line or the checkpoint: no room for it
                nospace.exit_process(f"cell {self.a.cell_id}: the core could not write", exc)
            raise

    def _checkpoint_failed(self, exc: BaseException) -> None:
        """A checkpoint write failed (on the writer's thread): a full disk ends the cell as such (the run
        stops once); anything else ends it as a dead thread does."""
        if nospace.is_full(exc) is not None:
            nospace.exit_process(f"cell {self.a.cell_id}: the core could not write its checkpoint", exc)
        raise exc

    def _train_steps(self) -> None:
        steps = self.run_dir / "steps.jsonl"
        while not self.stop.is_set():
            step = self._next_step()
            if step is None:
                continue
            t0 = time.time()
            rep = self.core.train_step(step)
            row = {**asdict(rep), "t_start": t0, "t_end": time.time()}
            with open(steps, "a") as fh:
                fh.write(json.dumps(row) + "\n")
            ckpt = ""
            if self.ckpt_writer is not None:
                t_state = time.perf_counter()
                state = self.core.state_dict()
                state_s = time.perf_counter() - t_state
                waited_s, copy_s = self.ckpt_writer.submit(state, Path(self.a.checkpoint))
                pinned = "page-locked" if self.ckpt_writer.buffers.pinned else "pageable"
                ckpt = (
                    f"; checkpoint {state_s + waited_s + copy_s:.2f} s after the step (its state"
                    f" {state_s:.2f} s, the last write {waited_s:.2f} s, the host copy {copy_s:.2f} s, {pinned})"
                )
            log.info("step %d applied: version %d, loss %.4f%s", rep.step, rep.version, rep.loss, ckpt)
            self._quiet_since = time.monotonic()

    def _next_step(self) -> QueuedStep | None:
        """The step to train next (a gyre-train `QueuedStep`), or None after a short wait. In training:
        the oldest accepted step, open or whole. In rollout: only one closed with no micro-batch, which
        the core skips with nothing to compute (no ready group counts for it, so no policy would move the
        cell to training for it)."""
        if self.training.is_set():
            return self.core.next_step(0.2)
        head = next(iter(self.core.steps()), None)
        if head is not None and head.closed and head.microbatches == 0:
            return self.core.next_step(0.0)
        self.training.wait(0.2)
        return None

    # ---- switches -----------------------------------------------------------------------------------
    def to_training(self) -> dict[str, float]:
        """Switch this cell to training; returns the seconds of each part (logged as `switch parts`)."""
        if not self.a.trains:
            raise RuntimeError(
                f"cell {self.a.cell_id} is rollout only (no trainer replica) but was sent to training"
            )
        t0 = time.monotonic()
        self.release_engine()
        t1 = time.monotonic()
        self._log_device_free("engine released")
        if self.a.is_core:
            self.core.set_computing(True)
            self.training.set()
        else:
            self.client.admit(self.name)
        return {"release_s": t1 - t0, "join_s": time.monotonic() - t1}

    def _log_device_free(self, when: str) -> None:
        """The GPU's free memory (every process on it counted), in the log: what training starts with."""
        if self.a.device != "cuda":
            return
        import torch

        free, total = torch.cuda.mem_get_info()
        log.info(
            "cell %d: %s: %.1f of %.1f GiB of the GPU free", self.a.cell_id, when, free / 2**30, total / 2**30
        )

    def to_rollout(self) -> dict[str, float]:
        """Switch this cell back to rollout; returns the seconds of each part."""
        from gyre_train.devmem import release_cached_memory

        t0 = time.monotonic()
        if self.a.is_core:
            self.training.clear()
            self.core.set_computing(False)  # the micro-batch in hand still counts
        else:
            self.client.dismiss(self.name)
        release_cached_memory()  # what training left reserved goes back before the engine asks for it
        t1 = time.monotonic()
        self.resume_engine()
        t2 = time.monotonic()
        self.sync_weights()
        t3 = time.monotonic()
        if self.sglang is not None and self.a.release_memory:
            self.sglang.continue_()  # paused by release_engine; its weights are current again
        return {"leave_s": t1 - t0, "resume_s": t2 - t1, "weights_s": t3 - t2}

    # ---- the scheduler side -------------------------------------------------------------------------
    def serve(self) -> None:
        codec = Codec()
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sock = dealer(ctx, self.a.sched)  # the run token: $GYRE_TOKEN (main() reads token_file into it)
        try:
            hb = self._register(sock, codec)
            last_sent = last_heard = last_probe = time.monotonic()
            done: list[SwitchDone] = []
            worker: threading.Thread | None = None

            def send(msg: Any) -> None:
                try:
                    sock.send(codec.encode(msg), zmq.NOBLOCK)
                except zmq.Again as exc:  # no connection to the scheduler right now
                    log.warning("cell %d: could not send %s: %s", self.a.cell_id, type(msg).__name__, exc)

            while not self.stop.is_set():
                # A main loop stuck for 20 s dumps every thread's stack into the log (diagnosis only).
                faulthandler.dump_traceback_later(20.0, exit=False)
                self.procs.check()
                if self.role is Role.TRAINING and time.monotonic() - self._quiet_since > QUIET_S:
                    log.warning(
                        "cell %d: training %.0f s without a step applied; stacks:", self.a.cell_id, QUIET_S
                    )
                    faulthandler.dump_traceback(all_threads=True)
                    self._quiet_since = time.monotonic()
                if self.fatal is not None:
                    raise RuntimeError(f"cell {self.a.cell_id}: switch failed: {self.fatal}") from self.fatal
                now = time.monotonic()
                # The scheduler only speaks when it has something to say: ask it, and fail if it stays silent.
                if now - last_heard > 60.0:
                    raise TimeoutError(f"scheduler at {self.a.sched} did not answer for 60 s")
                if now - last_heard > 5.0 and now - last_probe > 5.0:
                    send(GetState())
                    last_probe = now
                while done:
                    send(done.pop())
                    last_sent = now
                if now - last_sent >= hb / 2:
                    send(Heartbeat(self.a.cell_id, self.role))
                    last_sent = now
                if not sock.poll(50):
                    continue
                msg = codec.decode(sock.recv())
                last_heard = time.monotonic()
                if isinstance(msg, SwitchCommand):
                    if worker is not None and worker.is_alive():
                        worker.join()
                    worker = threading.Thread(target=self._switch, args=(msg, done), daemon=True)
                    worker.start()
                elif isinstance(msg, CellLost):
                    log.warning("cell %d lost (the core re-queues its claims itself)", msg.cell_id)
                elif isinstance(msg, Reject):
                    log.warning("scheduler: %s", msg.reason)
                # State (the answer to a probe), Welcome: nothing to do
        finally:
            faulthandler.cancel_dump_traceback_later()
            sock.close(0)
            ctx.term()

    def _register(self, sock: zmq.Socket[bytes], codec: Codec) -> float:
        """Hello until welcomed (a refusal is asked again until `startup_timeout_s`); the heartbeat."""
        hello = Hello(
            PeerKind.CELL,
            cell_id=self.a.cell_id,
            is_core=self.a.is_core,
            capacity=self.a.capacity,
            endpoint=self.url,
        )
        deadline = time.monotonic() + self.a.startup_timeout_s
        while True:
            sock.send(codec.encode(hello))
            if not sock.poll(30_000):
                raise TimeoutError(f"no Welcome from the scheduler at {self.a.sched} within 30 s")
            w = codec.decode(sock.recv())
            if isinstance(w, Welcome):
                up = self.run_dir / "cells" / f"{self.a.cell_id}.up"
                up.parent.mkdir(exist_ok=True)
                up.write_text(str(os.getpid()))
                return w.heartbeat_s
            if not isinstance(w, Reject):
                raise RuntimeError(f"expected Welcome, got {type(w).__name__}")
            if time.monotonic() > deadline or self.stop.is_set():
                raise RuntimeError(f"scheduler rejected cell {self.a.cell_id}: {w.reason}")
            log.warning("cell %d: scheduler refused (%s); asking again", self.a.cell_id, w.reason)
            self.stop.wait(1.0)

    def _switch(self, cmd: SwitchCommand, done: list[SwitchDone]) -> None:
        try:
            self._do_switch(cmd, done)
        except BaseException as exc:  # the main loop raises it: a cell that cannot switch stops
            log.exception("cell %d: switch to %s failed", self.a.cell_id, cmd.role.name)
            self.fatal = exc

    def _do_switch(self, cmd: SwitchCommand, done: list[SwitchDone]) -> None:
        t0 = time.monotonic()
        if cmd.role is Role.TRAINING:
            self.role = Role.TO_TRAINING
            self._quiet_since = time.monotonic()
            parts = self.to_training()
        else:
            self.role = Role.TO_ROLLOUT
            parts = self.to_rollout()
        self.role = cmd.role
        log.info("cell %d: now %s (%.2fs)", self.a.cell_id, cmd.role.name, time.monotonic() - t0)
        log.info("switch parts %s", json.dumps({"cell": self.a.cell_id, "to": cmd.role.name, **parts}))
        done.append(SwitchDone(self.a.cell_id, cmd.role, cmd.decision))

    def run(self) -> int:
        try:
            t_launch = time.time()
            self.launch_engine()
            self.start_trainer()  # while the engine loads: the core's addresses go out at once
            t_trainer = time.time()
            self.wait_engine()
            t_engine = time.time()
            first_pull_s = self.first_pull()
            self._startup_record(t_launch, t_trainer, t_engine, first_pull_s)
            threading.Thread(target=self.weight_loop, name="weights", daemon=True).start()
            self.serve()
        except StoppedWhileStarting as exc:
            log.info("%s", exc)  # SIGTERM during start-up: a clean stop, not a failure
        finally:
            self.stop.set()
            self.training.clear()
            if self.ckpt_writer is not None and not self.ckpt_writer.close(CHECKPOINT_WAIT_S):
                log.warning("cell %d: the last checkpoint was still being written after %.0f s; stopping "
                            "anyway (the one before it stays whole)", self.a.cell_id, CHECKPOINT_WAIT_S)  # fmt: skip
            if self.core is not None:
                self.core.close()  # stops the other ranks of a multi-rank core
            if self.rank_cell is not None:
                self.rank_cell.close()
            if self.sglang is not None:
                self.sglang.close()
            self.procs.close()
        return 0


def loss_config(a: CellArgs) -> LossConfig:
    """The core's policy loss: `[train] loss` with `[train] tis_cap` (0: off, or the tis loss's default
    cap) and the sampling temperature."""
    from gyre_traj.loss import LossConfig

    if a.loss == "tis":
        cap = {"tis_cap": a.tis_cap} if a.tis_cap > 0 else {}
        return LossConfig(mode="tis", temperature=a.temperature, **cap)
    return LossConfig(mode="ppo", temperature=a.temperature, ppo_tis_cap=a.tis_cap)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gyre cell", description="one cell of a single-machine gyre run")
    p.add_argument("--args", required=True, help="the cell's settings as JSON (written by `gyre run`)")
    ns = p.parse_args(argv)
    a = CellArgs(**json.loads(ns.args))
    if a.token_file:
        from gyre_base.token import TOKEN_ENV, read_token_file

        os.environ[TOKEN_ENV] = read_token_file(a.token_file)  # its engine, publisher and sockets too
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    cell = Cell(a)
    signal.signal(signal.SIGTERM, lambda *_: cell.stop.set())
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from gyre_train.devmem import use_expandable_segments

    use_expandable_segments()  # the trainer's allocator (this process), before its first allocation
    try:
        return cell.run()
    except Exception as exc:
        if nospace.is_full(exc) is None:
            raise
        nospace.exit_process(f"cell {a.cell_id}", exc)
