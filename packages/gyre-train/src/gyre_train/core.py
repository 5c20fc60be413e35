"""The core replica: authoritative weights, the only optimizer state (AdamW), step and version.

`Core.train_step` takes one mini-batch of checked micro-batches, puts them in a claim queue that the
core itself and every admitted satellite draw from (satellites over a ZeroMQ ROUTER socket served by a
helper thread), sums the returned gradients in micro-batch order, applies one AdamW update and publishes
the new weights as a gyre-xfer snapshot. Satellites connect once at start and stay connected; admitting
or dismissing one only changes which replicas the queue answers, so joining rebuilds nothing.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gyre_traj.loss import LossConfig, combine_metrics
from gyre_traj.pack import PackedBatch
from gyre_xfer.publisher import Publisher, PublisherConfig
from gyre_xfer.transport import Config as XferConfig
from gyre_xfer.transport import open_transport

from gyre_train.claims import StepState
from gyre_train.engine_sync import (
    PushReport,
    SGLangSyncConfig,
    SGLangWeightSync,
    WeightSyncError,
    engine_tensors,
)
from gyre_train.model import Attention, Layout, ModelConfig, micro_gradient, params, set_gradients
from gyre_train.protocol import ArraySpec
from gyre_train.server import ReplicaServer
from gyre_train.wire import MicroBatchError, check_microbatch, microbatch_arrays, to_frames

CORE = "core"


class StepTimeoutError(TimeoutError):
    """The mini-batch did not complete within `step_timeout_s`."""


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    """Clip the summed gradient to this global norm (0 = no clipping)."""


@dataclass(frozen=True)
class CoreConfig:
    bind: str = "tcp://127.0.0.1:0"
    """ROUTER address satellites connect to (loopback unless you mean otherwise)."""
    transport: str = "shm"
    """gyre-xfer transport for snapshots: "shm" (one host) or "mooncake" (TCP/RDMA)."""
    token_budget: int = 16384
    """Largest micro-batch accepted (tokens)."""
    attention: Attention = "dense"
    """"dense" 4D boolean ancestor mask (CPU) or "flex" FlexAttention BlockMask (GPU)."""
    admit_on_hello: bool = False
    """Admit every satellite as soon as it says hello (standalone runs; a scheduler admits explicitly)."""
    chunk_budget: int = 0
    """Train a micro-batch with more tokens than this in chunks with the shared prefix computed once
    (activation memory of one chunk; `token_budget` may then be far larger). 0 = off."""
    core_computes: bool = True
    """The core claims micro-batches too (False: it only aggregates)."""
    heartbeat_s: float = 0.5
    """How often satellites send a heartbeat."""
    dead_after_s: float = 5.0
    """A satellite silent this long is dead: its claims go back to the queue."""
    idle_hold_s: float = 1.0
    """How long a claim with no work is held before answering Idle (long poll)."""
    step_timeout_s: float = 3600.0
    inbox: int = 4
    """Mini-batches the trajectory service may queue ahead (`Submit`); more are refused until one is taken."""
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    engines: SGLangSyncConfig | None = None
    """Also push every version to these engines through SGLang's weight-update endpoints
    (`engine_sync.py`; the group is formed once, in the constructor). None: gyre-xfer snapshots only."""


@dataclass(frozen=True)
class Staleness:
    """Behaviour-policy lag of the loss tokens of one mini-batch: trainer version - token version."""

    max: int
    mean: float
    tokens_by_lag: dict[int, int]


@dataclass(frozen=True)
class StepReport:
    step: int
    version: int
    """Trainer weight version after this update."""
    snapshot: int
    """gyre-xfer snapshot version holding it."""
    queue_position: int
    microbatches: int
    by_replica: dict[str, int]
    requeued: int
    loss: float
    grad_norm: float
    staleness: Staleness
    elapsed_s: float
    engine_push: PushReport | None = None
    """The push of this version to the SGLang-protocol engines (`CoreConfig.engines`)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The loss's metrics over the mini-batch (gyre-traj `combine_metrics`: approx_kl, clip_frac,
    ratio_mean, entropy where the backend reports it, loss tokens)."""


class Core:
    def __init__(self, model: torch.nn.Module, model_cfg: ModelConfig, cfg: CoreConfig | None = None) -> None:
        self.cfg = cfg or CoreConfig()
        self.model = model
        self.model_cfg = model_cfg
        self.layout = Layout.of(model)
        self.device = next(model.parameters()).device
        """Where the gradient sum is kept (the model's device)."""
        o = self.cfg.optim
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
        )
        self.step = 0
        self.version = 0
        self.queue_position = 0
        self._batch_seq = 0
        self._inbox: deque[list[PackedBatch]] = deque()
        self._next_seq = 0
        self._transport = open_transport(XferConfig(kind=self.cfg.transport))
        self.publisher = Publisher(self._transport, PublisherConfig())
        self.snapshot = self.publisher.publish(params(model))
        self._lock = threading.Condition()
        self._state: StepState | None = None
        self._frames: list[tuple[tuple[ArraySpec, ...], list[Any]]] = []
        self._metrics: dict[int, dict[str, float]] = {}
        self._server = ReplicaServer(self)
        self.address = self._server.address
        self.engine_sync: SGLangWeightSync | None = None
        self.last_push: PushReport | None = None
        if self.cfg.engines is not None:
            try:
                self.engine_sync = SGLangWeightSync(self.cfg.engines)
                self.engine_sync.connect()
                if self.cfg.engines.push_at_start:
                    self.push_to_engines()
            except BaseException:
                self.close()
                raise

    # ---- membership (what the scheduler calls) ----------------------------------------------------

    def admit(self, replica: str) -> None:
        """Let `replica` claim micro-batches from now on (it pulls the current snapshot first)."""
        self._server.admit(replica)

    def dismiss(self, replica: str) -> None:
        """Stop giving `replica` work; the micro-batch it is computing still counts."""
        self._server.dismiss(replica)

    def replicas(self) -> dict[str, dict[str, float | bool | int]]:
        return self._server.describe()

    def offer(self, seq: int, microbatches: list[PackedBatch]) -> tuple[bool, str]:
        """Queue mini-batch `seq` from the trajectory service. It must be the next queue position (so a
        resumed core tells the feeder where to restart, and a repeat or a gap is refused), fit the inbox,
        and pass the micro-batch checks; a refusal says why and queues nothing."""
        with self._lock:
            # Positions already accepted (waiting, being trained or trained) are not offered again.
            want = max(self._next_seq, self.queue_position + (self._state is not None))
            if seq != want:
                return False, f"mini-batch {seq} out of order: the core expects {want}"
            if len(self._inbox) >= self.cfg.inbox:
                return False, f"inbox full ({self.cfg.inbox} mini-batches): submit again later"
        self.check(microbatches)
        with self._lock:
            if max(self._next_seq, self.queue_position) != want:
                return False, f"mini-batch {seq} was offered twice at once"
            self._inbox.append(microbatches)
            self._next_seq = want + 1
            self._lock.notify_all()
        return True, ""

    def next_minibatch(self, timeout_s: float) -> list[PackedBatch] | None:
        """The oldest submitted mini-batch, or None if none arrives within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while not self._inbox:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._lock.wait(timeout=min(left, 0.1))
            return self._inbox.popleft()

    def pending(self) -> int:
        """Micro-batches of the step in progress that nobody has claimed yet (0 between steps)."""
        with self._lock:
            return 0 if self._state is None else len(self._state.pending)

    # ---- the claim queue, shared with the server thread --------------------------------------------

    def _claim(self, replica: str) -> tuple[StepState, int] | None:
        with self._lock:
            st = self._state
            if st is None:
                return None
            i = st.claim(replica)
            return None if i is None else (st, i)

    def _deliver(
        self,
        replica: str,
        batch: int,
        index: int,
        version: int,
        grad: np.ndarray | torch.Tensor,
        metrics: dict[str, float] | None = None,
    ) -> tuple[bool, str]:
        with self._lock:
            st = self._state
            if st is None or st.batch != batch:
                return False, f"mini-batch {batch} is not in progress"
            if version != st.version:
                return False, f"gradient at version {version}, the step is at {st.version}"
            ok = st.deliver(replica, index, grad)
            if ok:
                self._metrics[index] = dict(metrics or {})
            self._lock.notify_all()
            return ok, "" if ok else f"micro-batch {index} already done"

    def _release(self, replica: str, indices: list[int] | None = None) -> int:
        with self._lock:
            st = self._state
            n = 0 if st is None else st.release(replica, indices)
            self._lock.notify_all()
            return n

    def assignment(self, index: int) -> tuple[tuple[ArraySpec, ...], list[Any]]:
        return self._frames[index]

    # ---- training ----------------------------------------------------------------------------------

    def check(self, microbatches: Sequence[PackedBatch]) -> None:
        """Refuse the whole mini-batch (nothing enqueued) if any micro-batch is malformed."""
        for i, b in enumerate(microbatches):
            check_microbatch(
                b, token_budget=self.cfg.token_budget, vocab_size=self.model_cfg.vocab_size, where=str(i)
            )
            if b.num_loss_tokens and int(b.versions.max()) > self.version:
                raise MicroBatchError(
                    f"micro-batch {i}: tokens sampled at version {int(b.versions.max())}, "
                    f"newer than the trainer's {self.version}"
                )

    def train_step(
        self, microbatches: Sequence[PackedBatch], on_progress: Callable[[int], None] | None = None
    ) -> StepReport:
        """One optimizer update over one mini-batch; `on_progress(k)` after each core micro-batch."""
        t0 = time.perf_counter()
        self.check(microbatches)
        frames = []
        for b in microbatches:
            specs, bufs = to_frames(microbatch_arrays(b))
            frames.append((specs, bufs))
        with self._lock:
            self._frames = frames
            self._metrics = {}
            self._batch_seq += 1  # unique for this process's life, so no late gradient can match a later step
            self._state = StepState(
                self._batch_seq, len(microbatches), self.layout.numel, self.version, device=self.device
            )
            st = self._state
        scratch = torch.empty(self.layout.numel, dtype=torch.float32, device=self.device)
        deadline = time.monotonic() + self.cfg.step_timeout_s
        try:
            while True:
                got = self._claim(CORE) if self.cfg.core_computes else None
                if got is not None:
                    _, i = got
                    g, m = micro_gradient(
                        self.model,
                        self.layout,
                        microbatches[i],
                        self.cfg.loss,
                        self.cfg.attention,
                        scratch,
                        self.cfg.chunk_budget,
                    )
                    self._deliver(CORE, st.batch, i, st.version, g, m)  # copied into the sum
                    if on_progress is not None:
                        on_progress(len(st.done))
                    continue
                with self._lock:
                    if st.complete:
                        break
                    if time.monotonic() > deadline:
                        raise StepTimeoutError(
                            f"mini-batch {st.batch}: {len(st.done)} of {st.n} micro-batches after "
                            f"{self.cfg.step_timeout_s} s"
                        )
                    self._lock.wait(timeout=0.05)
            grad = st.gradient()
            metrics = dict(self._metrics)
        finally:
            with self._lock:
                self._state = None
                self._frames = []
        grad_norm = self._apply(grad)
        loss = float(sum(metrics[i].get("loss", 0.0) for i in sorted(metrics)))
        self.step += 1
        self.version += 1
        self.queue_position += 1
        self.snapshot = self.publisher.publish(params(self.model))
        push = self.push_to_engines() if self.engine_sync is not None else None
        by_replica: dict[str, int] = {}
        for r in st.done.values():
            by_replica[r] = by_replica.get(r, 0) + 1
        return StepReport(
            step=self.step,
            version=self.version,
            snapshot=self.snapshot,
            queue_position=self.queue_position,
            microbatches=st.n,
            by_replica=by_replica,
            requeued=st.requeued,
            loss=loss,
            grad_norm=grad_norm,
            staleness=staleness(microbatches, st.version),
            elapsed_s=time.perf_counter() - t0,
            engine_push=push,
            metrics=combine_metrics([metrics[i] for i in sorted(metrics)]),
        )

    def _apply(self, grad: torch.Tensor) -> float:
        set_gradients(self.model, self.layout, grad)
        mx = self.cfg.optim.max_grad_norm
        norm = float(torch.linalg.vector_norm(grad, dtype=torch.float64))
        if mx > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), mx)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def train_burst(
        self, minibatches: Sequence[Sequence[PackedBatch]], on_progress: Callable[[int], None] | None = None
    ) -> list[StepReport]:
        """mu > 1: several optimizer steps back to back, one per mini-batch, in the order given (not
        shuffled across the burst); satellites pull each new version before their next micro-batch."""
        return [self.train_step(mb, on_progress) for mb in minibatches]

    def republish(self) -> int:
        """Publish the current weights as a new snapshot (after loading a checkpoint), and push them to
        the SGLang-protocol engines if there are any."""
        self.snapshot = self.publisher.publish(params(self.model))
        if self.engine_sync is not None:
            self.push_to_engines()
        return self.snapshot

    def push_to_engines(self) -> PushReport:
        """Push the current weights (transformers layout) to the engines of `CoreConfig.engines`, labelled
        with the core's version. Called after every update; call it again to retry a failed push (after
        `engine_sync.reconnect()` if the group broke)."""
        if self.engine_sync is None:
            raise WeightSyncError("no engines configured (CoreConfig.engines)")
        try:
            self.last_push = self.engine_sync.push(engine_tensors(self.model, self.model_cfg), self.version)
        except WeightSyncError as exc:
            raise WeightSyncError(
                f"step {self.step} is applied (version {self.version}, snapshot {self.snapshot}), but the "
                f"engines did not get it: {exc}"
            ) from exc
        return self.last_push

    def save(self, path: Path) -> Path:
        """Checkpoint weights, optimizer state, step, version and queue position (between steps)."""
        from gyre_train.checkpoint import save

        with self._lock:
            if self._state is not None:
                raise RuntimeError("checkpoint between steps, not during one")
        return save(self, path)

    def load(self, path: Path) -> None:
        """Resume from a checkpoint written by `save` (same model architecture and optimizer)."""
        from gyre_train.checkpoint import load

        load(self, path)

    def close(self) -> None:
        if getattr(self, "engine_sync", None) is not None:
            sync, self.engine_sync = self.engine_sync, None
            assert sync is not None
            sync.close()
        self._server.close()
        self.publisher.close()
        self._transport.close()


def staleness(microbatches: Sequence[PackedBatch], version: int) -> Staleness:
    lags: dict[int, int] = {}
    total = 0
    n = 0
    for b in microbatches:
        if b.num_loss_tokens == 0:
            continue
        lag = version - b.versions.astype(np.int64)
        vals, counts = np.unique(lag, return_counts=True)
        for v, c in zip(vals.tolist(), counts.tolist(), strict=True):
            lags[int(v)] = lags.get(int(v), 0) + int(c)
        total += int(lag.sum())
        n += int(lag.shape[0])
    return Staleness(max(lags) if lags else 0, total / n if n else 0.0, dict(sorted(lags.items())))
