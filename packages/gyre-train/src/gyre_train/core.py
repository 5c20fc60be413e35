"""The core replica: authoritative weights, the only optimizer state (AdamW), step and version.

`Core.train_step` trains one step of the claim queue (`claimqueue.py`): a whole mini-batch, or a step
the trajectory service opened and feeds as its groups become ready. The core itself and every admitted
satellite (over a ZeroMQ ROUTER socket served by a helper thread, `server.py`) claim its micro-batches as
they arrive; a satellite's gradient reaches the core's sum through gyre-xfer (the `Gradient` header
names its buckets; `handoff.py`), in the configured wire dtype. Once the step is closed and every
gradient is in, the in-order sum (`shardsum.py`) divided by the step's execution count becomes one AdamW
update, published as a gyre-xfer snapshot. Satellites connect once at
start and stay connected; admitting or dismissing one only changes which replicas the queue answers, so
joining rebuilds nothing. A step with no micro-batches is skipped: its queue position is taken, no update
is made, and the report says `skipped`.

The core may be a multi-rank cell (`cell.py`: Megatron tensor and pipeline parallelism, data-parallel
copies): the `Core` is then rank 0's, and every operation on the model, the sums and the optimizer runs
on all ranks at once (`corecell.py`; the other ranks run `follower.follow`). A satellite is a cell of
the same shape, whose rank r hands its gradient shard to core rank r, or one rank beside a core of one
pipeline stage: it pulls the whole model's weights and hands its whole gradient, of which every core
rank adds its own part (the split of its parameters, then its data-parallel slice).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
import torch
from gyre_traj.loss import LossConfig, Mismatch, combine_metrics, combine_mismatch
from gyre_traj.pack import PackConfig, PackedBatch, PackError

from gyre_train import batchlog, checkpoint
from gyre_train.cell import Cell
from gyre_train.checkpoint import CheckpointError, OptimizerState, TrainerState
from gyre_train.claimqueue import Assignment, ClaimQueue, QueuedStep, Verdict
from gyre_train.corecell import CoreCell
from gyre_train.corerank import MOMENTS, CoreRank, OptimConfig, RankWork
from gyre_train.defaults import CHUNK_BUDGET, CHUNK_MEMORY, MISMATCH_WARN
from gyre_train.devmem import peak_gib_since_last, release_cached_memory
from gyre_train.engine_sync import (
    PushReport,
    SGLangSyncConfig,
    SGLangWeightSync,
    WeightSyncError,
    megatron_hf,
)
from gyre_train.handoff import DEFAULT_BUCKET_BYTES
from gyre_train.model import Attention, ChunkMemory, ModelConfig
from gyre_train.protocol import PROTOCOL, CellShape, RankSetup, StepInfo, Welcome
from gyre_train.server import ReplicaServer, ServerConfig
from gyre_train.wire import MicroBatchError, check_microbatch

__all__ = ["CORE", "Core", "CoreConfig", "GradientResult", "OptimConfig", "StepReport", "StepTimeoutError"]

CORE = "core"
log = logging.getLogger("gyre_train.core")


class StepTimeoutError(TimeoutError):
    """A step did not complete within `step_timeout_s` of its close, or stayed open `open_timeout_s`."""


@dataclass(frozen=True)
class CoreConfig:
    bind: str = "tcp://127.0.0.1:0"
    """ROUTER address satellites connect to (loopback unless you mean otherwise; beyond loopback it
    needs a token)."""
    transport: str = "shm"
    """gyre-xfer transport for snapshots and satellites' gradients: "shm" (one host) or "mooncake"
    (TCP here, RDMA on clusters)."""
    wire_dtype: str = "float32"
    """The dtype every micro-batch gradient is handed over in, and rounded to once where it is computed
    (the core's own too): "float32" (the sum equals one replica's) or "bfloat16" (half the bytes; the sum
    is still the same whoever computes what, but each micro-batch's gradient is rounded to bf16)."""
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Largest bucket of a gradient shard (one transfer entry; the header names every bucket)."""
    transfer_timeout_s: float = 30.0
    """Deadline for reading one gradient's shards; past it the claim is re-queued."""
    token_budget: int = PackConfig.token_budget
    """Largest micro-batch accepted (tokens)."""
    attention: Attention = "dense"
    """"dense" 4D boolean ancestor mask (CPU) or "flex" FlexAttention BlockMask (GPU)."""
    admit_on_hello: bool = False
    """Admit every satellite as soon as it says hello (standalone runs; a scheduler admits explicitly)."""
    chunk_budget: int = CHUNK_BUDGET
    """Train a micro-batch with more tokens than this in chunks with the shared prefix computed once
    (activation memory of one chunk; `token_budget` may then be far larger). 0 = off."""
    chunk_memory: ChunkMemory = CHUNK_MEMORY
    """How a chunked micro-batch keeps what its chunks share: "auto", "kept", "layers" or "layers-host"
    (`gyre_train.defaults.CHUNK_MEMORY` says what each is)."""
    core_computes: bool = True
    """The core claims micro-batches too (False: it only aggregates); `Core.set_computing` changes it
    while running."""
    heartbeat_s: float = 0.5
    """How often satellites send a heartbeat."""
    dead_after_s: float = 5.0
    """A satellite silent this long is dead: its claims go back to the queue."""
    idle_hold_s: float = 1.0
    """How long a claim with no work is held before answering Idle (long poll)."""
    step_timeout_s: float = 3600.0
    """A closed step must complete within this long of its close (or of its start, if it came closed)."""
    open_timeout_s: float = 86400.0
    """A training step still open this long after it started is abandoned (`StepTimeoutError`): its
    feeder is presumed gone."""
    inbox: int = 4
    """Steps the trajectory service may have accepted ahead of the one training (open or closed); more
    are refused (`Refusal.INBOX_FULL`) until one is taken."""
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    engines: SGLangSyncConfig | None = None
    """Also push every version to these engines through SGLang's weight-update endpoints
    (`engine_sync.py`; the group is formed once, in the constructor). None: gyre-xfer snapshots only."""
    mismatch_warn: float = MISMATCH_WARN
    """Log a warning for a step whose train-inference mismatch (`StepReport.mismatch`: mean |trainer -
    behaviour logprob| over its on-policy tokens) is above this; 0: never."""
    keep_batches: str = ""
    """A directory: each applied step's micro-batches are written there (`batchlog.py`), so the same
    training can be timed again alone; empty: none kept."""
    token: str = field(default="", repr=False)
    """The run token (gyre-base `sockets`): satellites and `CoreClient`s must hold it to be answered, and the
    weight publishers use it too; empty: $GYRE_TOKEN, or none (then every listener stays on loopback)."""


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
    executions: int = 1
    """What the summed gradient (and `loss`) was divided by (`CloseStep.executions`)."""
    skipped: bool = False
    """The mini-batch had no micro-batches: its queue position was taken with no update (step, version
    and snapshot are unchanged)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The loss's metrics over the mini-batch (gyre-traj `combine_metrics`: approx_kl, clip_frac,
    ratio_mean, entropy where the backend reports it, loss tokens)."""
    mismatch: Mismatch = field(default_factory=Mismatch)
    """Train-inference mismatch over the step's on-policy loss tokens (sampled at the version the step
    trained from, so the engine's recorded logprobs and the trainer's recomputation saw the same weights):
    mean and max |trainer - behaviour logprob| and the K3 estimate of KL(behaviour || trainer) (gyre-traj
    `Mismatch`), summed exactly over every micro-batch, the core's and the satellites'."""


@dataclass(frozen=True)
class GradientResult:
    """What `Core.gradient` computed."""

    loss: float
    gradient: dict[str, torch.Tensor]
    """The summed gradient, whole, by one-rank parameter name."""
    compute_s: float
    """Forward and backward of every micro-batch, summed (as the ranks that computed the loss timed it;
    with model parallelism that includes waiting for the other ranks)."""
    tokens: int


class Core:
    """The core replica. Its shared state (queued mini-batches, the claims of the step in progress, the
    trainer's position) lives in a `ClaimQueue` that its server thread uses too; checkpoints go through
    `state_dict()` / `load_state_dict()`."""

    def __init__(
        self,
        model: torch.nn.Module,
        model_cfg: ModelConfig,
        cfg: CoreConfig | None = None,
        cell: Cell | None = None,
    ) -> None:
        """`model`: this process's model (rank 0's part of it in a multi-rank `cell`, whose other ranks
        run `follower.follow(cell)` and build theirs when this constructor tells them to)."""
        self.cfg = cfg or CoreConfig()
        c = self.cfg
        if cell is not None and cell.rank != 0:
            raise ValueError(
                f"the Core runs on rank 0 of its cell; rank {cell.rank} runs follower.follow(cell)"
            )
        self.cell = cell
        self.model = model
        self.model_cfg = model_cfg
        work = RankWork(
            c.loss,
            c.attention,
            c.chunk_budget,
            c.transport,
            c.wire_dtype,
            c.transfer_timeout_s,
            c.optim,
            c.token,
            c.chunk_memory,
        )
        rank0 = CoreRank(model, work, cell)
        self.layout = rank0.layout
        """This rank's parameter layout (the whole model's on a one-rank core)."""
        self.device = rank0.device
        """Where the gradient sum is kept (the model's device)."""
        self.optimizer = rank0.optimizer
        self._computing = threading.Event()
        self.released_bytes = 0
        """Device memory given back to the driver after computing stopped (`devmem`), in total."""
        if c.core_computes:
            self._computing.set()
        self._updating = threading.Lock()
        """Held while an update is applied and published, and while `state_dict` reads the state."""
        try:
            self._cell = CoreCell(rank0, cell, self._setup() if cell is not None else None)
        except BaseException:
            rank0.close()
            raise
        self.publisher = self._cell.engine_publisher
        """What engines load: the whole model (gathered to rank 0 when the model is split)."""
        self._queue = ClaimQueue(self.check, c.inbox)
        self._queue.published(self._cell.publish())
        try:
            self._server = ReplicaServer(
                ServerConfig(
                    bind=c.bind,
                    token=c.token,
                    admit_on_hello=c.admit_on_hello,
                    dead_after_s=c.dead_after_s,
                    idle_hold_s=c.idle_hold_s,
                ),
                self._queue,
                self._welcome(),
                self._cell.receive,
            )
        except BaseException:
            self._cell.close()
            raise
        self.address = self._server.address
        self.engine_sync: SGLangWeightSync | None = None
        self.last_push: PushReport | None = None
        if c.engines is not None:
            try:
                self.engine_sync = SGLangWeightSync(c.engines)
                self.engine_sync.connect()
                if c.engines.push_at_start:
                    self.push_to_engines()
            except BaseException:
                self.close()
                raise

    def _setup(self) -> RankSetup:
        """What the other ranks of the cell build (sent once, by `CoreCell`)."""
        c = self.cfg
        return RankSetup(
            "core",
            self.model_cfg.to_json(),
            msgspec.json.encode(c.loss).decode(),
            c.attention,
            c.chunk_budget,
            self.device.type,
            c.transport,
            c.wire_dtype,
            c.bucket_bytes,
            optim=msgspec.json.encode(c.optim).decode(),
            transfer_timeout_s=c.transfer_timeout_s,
        )

    def _welcome(self) -> Welcome:
        c = self.cfg
        return Welcome(
            PROTOCOL,
            self.publisher.address,
            c.transport,
            c.heartbeat_s,
            self.model_cfg.to_json(),
            msgspec.json.encode(c.loss).decode(),
            c.attention,
            c.chunk_budget,
            self.cell.cfg.shape if self.cell is not None else CellShape(),
            self._cell.publishers,
            c.wire_dtype,
            c.bucket_bytes,
            self._cell.engine_publisher.address,
        )

    # ---- the trainer's position (read from the claim queue, which the server reads too) ------------

    @property
    def step(self) -> int:
        """Optimizer updates applied."""
        return self._queue.position().step

    @property
    def version(self) -> int:
        """Weight version (one per update)."""
        return self._queue.position().version

    @property
    def snapshot(self) -> int:
        """gyre-xfer snapshot holding the current weights."""
        return self._queue.position().snapshot

    @property
    def queue_position(self) -> int:
        """Mini-batches taken (trained or skipped): the next one to train has this number."""
        return self._queue.position().queue_position

    # ---- membership (what the scheduler calls) ----------------------------------------------------

    def admit(self, replica: str) -> None:
        """Let `replica` claim micro-batches from now on (it pulls the current snapshot first)."""
        self._server.admit(replica)

    def dismiss(self, replica: str) -> None:
        """Stop giving `replica` work; the micro-batch it is computing still counts."""
        self._server.dismiss(replica)

    def replicas(self) -> dict[str, dict[str, float | bool | int]]:
        return self._server.describe()

    def presumed_dead(self) -> list[str]:
        """Satellites declared dead so far (silent for `dead_after_s`; their claims were re-queued)."""
        return self._server.presumed_dead()

    # ---- steps from the trajectory service (over the socket: `control.CoreClient`) -------------------

    def offer(self, seq: int, microbatches: list[PackedBatch], executions: int = 1) -> Verdict:
        """Accept step `seq` whole and closed (what a `Submit` does; an empty one is skipped in its
        turn). It must be the next queue position (so a resumed core tells the feeder where to restart,
        and a repeat or a gap is refused), fit the inbox, and pass the micro-batch checks (else
        MicroBatchError); a refusal says which and why, and accepts nothing."""
        return self._queue.submit(seq, microbatches, executions)

    def next_step(self, timeout_s: float) -> QueuedStep | None:
        """The oldest accepted step not training yet (open or closed: `train_step` takes it as it is and
        trains what arrives), or None if none is accepted within `timeout_s`."""
        return self._queue.next_step(timeout_s)

    next_minibatch = next_step
    """The former name of `next_step` (callers pass its result to `train_step` either way)."""

    def steps(self) -> tuple[StepInfo, ...]:
        """Every accepted step not yet applied, oldest first, with what it holds (as `Status` reports)."""
        return self._queue.steps()

    def pending(self) -> int:
        """Micro-batches of the step training that nobody has claimed yet (0 between steps)."""
        return self._queue.pending()

    # ---- training ----------------------------------------------------------------------------------

    def check(self, microbatches: Sequence[PackedBatch]) -> None:
        """Refuse the whole mini-batch (nothing enqueued) if any micro-batch is malformed."""
        version = self.version
        for i, b in enumerate(microbatches):
            check_microbatch(
                b, token_budget=self.cfg.token_budget, vocab_size=self.model_cfg.vocab_size, where=str(i)
            )
            if b.num_loss_tokens and int(b.versions.max()) > version:
                raise MicroBatchError(
                    f"micro-batch {i}: tokens sampled at version {int(b.versions.max())}, "
                    f"newer than the trainer's {version}"
                )

    def warm_up(self, rounds: int) -> float:
        """Compute `rounds` synthetic micro-batches of different lengths as a step would, and apply nothing
        (weights, AdamW state, version and the step queue stay as they were): on a GPU this compiles the
        attention kernels for dynamic shapes before the first real step (with `chunk_budget`, each round
        adds a micro-batch above it, so the chunked path runs once too), as a satellite does at its start;
        the allocator's idle blocks go back to the driver after. Call before any step is queued and
        before satellites join. Returns the seconds taken (0 for `rounds` <= 0)."""
        if rounds <= 0:
            return 0.0
        from gyre_train.data import warmup_microbatches

        t0 = time.perf_counter()
        c = self.cfg
        try:
            mbs = [
                mb
                for k in range(rounds)
                for mb in warmup_microbatches(
                    2000 + k, self.model_cfg.vocab_size, c.token_budget, c.chunk_budget
                )
            ]
        except PackError as exc:  # a budget below the synthetic agent's paths: nothing to warm up with
            log.info("core warm-up skipped: %s", exc)
            return 0.0
        was = self._computing.is_set()
        self.set_computing(True)
        try:
            self.gradient(mbs)
        finally:
            self.set_computing(was)
        self.released_bytes += release_cached_memory()  # an engine on the same GPU may need it now
        dt = time.perf_counter() - t0
        log.info("core warmed up on %d synthetic micro-batches in %.2f s", len(mbs), dt)
        return dt

    def set_computing(self, on: bool) -> None:
        """Let the core claim micro-batches itself (True) or only aggregate and apply (False), from its
        next claim on; the micro-batch it is computing still counts."""
        if on:
            self._computing.set()
        else:
            self._computing.clear()

    def train_step(
        self,
        step: QueuedStep | Sequence[PackedBatch],
        on_progress: Callable[[int], None] | None = None,
    ) -> StepReport:
        """One optimizer update over one step: an accepted step (`next_step`, possibly still open: its
        micro-batches are claimed as they arrive, and the update is applied once it is closed and every
        gradient is in), or a whole mini-batch given here (for a core without feeders). `on_progress(k)`
        after each micro-batch the core computes (k = gradients in so far). A step of no micro-batch
        takes its queue position with no update (`StepReport.skipped`)."""
        t0 = time.perf_counter()
        version = self.version
        if isinstance(step, QueuedStep):
            self._queue.begin(step)
        else:
            self.check(step)
            self._queue.begin_local(step)
        try:
            self._compute_until_complete(on_progress)
            res = self._queue.finish()
        except BaseException:
            self._queue.abort()
            raise
        if not res.microbatches:
            return self._skip(t0)
        if self.cfg.keep_batches:
            batchlog.write_step(Path(self.cfg.keep_batches), res.seq, res.microbatches, res.executions)
        with self._updating:
            grad_norm = self._cell.apply(res.batch, len(res.microbatches), res.executions)
            pos = self._queue.applied(self._cell.publish())
        push = self.push_to_engines() if self.engine_sync is not None else None
        if not self._computing.is_set():  # applied after the cell went back to rollout
            self.released_bytes += release_cached_memory()
        by_replica: dict[str, int] = {}
        for r in res.done.values():
            by_replica[r] = by_replica.get(r, 0) + 1
        parts = [res.metrics[i] for i in sorted(res.metrics)]
        loss = float(sum(m.get("loss", 0.0) for m in parts))
        mismatch = combine_mismatch(parts, version)
        self._warn_mismatch(pos.step, mismatch)
        return StepReport(
            step=pos.step,
            version=pos.version,
            snapshot=pos.snapshot,
            queue_position=pos.queue_position,
            microbatches=len(res.microbatches),
            by_replica=by_replica,
            requeued=res.requeued,
            loss=loss / res.executions,
            grad_norm=grad_norm,
            staleness=staleness(res.microbatches, version),
            elapsed_s=time.perf_counter() - t0,
            engine_push=push,
            executions=res.executions,
            metrics=combine_metrics(parts),
            mismatch=mismatch,
        )

    def _warn_mismatch(self, step: int, m: Mismatch) -> None:
        limit = self.cfg.mismatch_warn
        if limit > 0 and m.tokens and m.abs_mean > limit:
            log.warning(
                "step %d: train-inference mismatch mean |logprob diff| %.4f > mismatch_warn %g over %d "
                "on-policy tokens (max %.4f, K3 KL %.4f): the engine and the trainer disagree on the same "
                "weights (dtype, kernels, temperature, or weights not loaded)",
                step, m.abs_mean, limit, m.tokens, m.abs_max, m.k3,
            )  # fmt: skip

    def _compute_until_complete(self, on_progress: Callable[[int], None] | None) -> None:
        """Claim and compute micro-batches of the step training (while computing is on) until it is
        closed and every one is in, satellites' included; StepTimeoutError past the deadlines."""
        started = time.monotonic()
        closed_at: float | None = None
        computed = False
        while True:
            assignments = self._claim_round() if self._computing.is_set() else []
            if assignments:
                a0 = assignments[0]
                c0 = time.monotonic()
                metrics = self._cell.compute(a0.batch, assignments)  # every rank sums its slices
                for a, m in zip(assignments, metrics, strict=True):
                    self._queue.deliver(CORE, a.batch, a.index, a.version, m)
                info = self._queue.progress()
                peak = peak_gib_since_last()
                log.info(
                    "step %d: micro-batches %s (%d tokens) computed in %.2f s (%d of %d in)%s",
                    info.seq, ",".join(str(a.index) for a in assignments),
                    sum(a.microbatch.num_tokens for a in assignments), time.monotonic() - c0,
                    info.done, info.microbatches, "" if peak is None else f"; peak {peak:.1f} GiB on the GPU",
                )  # fmt: skip
                if on_progress is not None:
                    on_progress(self._queue.progress().done)
                computed = True
                continue
            if computed and not self._computing.is_set():  # the cell went back to rollout mid-step
                self.released_bytes += release_cached_memory()
                computed = False
            if self._queue.wait_complete(0.05):
                return
            info = self._queue.progress()
            now = time.monotonic()
            if info.closed and closed_at is None:
                closed_at = now
            late = (closed_at is not None and now - closed_at > self.cfg.step_timeout_s) or (
                closed_at is None and now - started > self.cfg.open_timeout_s
            )
            if late:
                raise StepTimeoutError(
                    f"step {info.seq}: {info.done} of {info.microbatches} micro-batches in after "
                    + (
                        f"{self.cfg.step_timeout_s} s closed"
                        if closed_at
                        else f"{self.cfg.open_timeout_s} s open"
                    )
                )

    def _claim_round(self) -> list[Assignment]:
        """Up to one micro-batch per data-parallel copy of the core, for one round."""
        dp = self.cell.cfg.dp if self.cell is not None else 1
        out: list[Assignment] = []
        while len(out) < dp and (a := self._queue.claim(CORE)) is not None:
            out.append(a)
        return out

    def _skip(self, t0: float) -> StepReport:
        pos = self._queue.skipped()
        log.warning("step %d has no micro-batches: skipped (no update)", pos.queue_position - 1)
        return StepReport(
            step=pos.step,
            version=pos.version,
            snapshot=pos.snapshot,
            queue_position=pos.queue_position,
            microbatches=0,
            by_replica={},
            requeued=0,
            loss=0.0,
            grad_norm=0.0,
            staleness=Staleness(0, 0.0, {}),
            elapsed_s=time.perf_counter() - t0,
            skipped=True,
        )

    def train_burst(
        self, minibatches: Sequence[Sequence[PackedBatch]], on_progress: Callable[[int], None] | None = None
    ) -> list[StepReport]:
        """mu > 1: several optimizer steps back to back, one per mini-batch, in the order given (not
        shuffled across the burst); satellites pull each new version before their next micro-batch."""
        return [self.train_step(mb, on_progress) for mb in minibatches]

    def republish(self) -> int:
        """Publish the current weights as a new snapshot (after loading a checkpoint), and push them to
        the SGLang-protocol engines if there are any."""
        snapshot = self._cell.publish()
        self._queue.published(snapshot)
        if self.engine_sync is not None:
            self.push_to_engines()
        return snapshot

    # ---- the whole model, wherever its parts are ---------------------------------------------------------

    def whole_weights(self) -> dict[str, torch.Tensor]:
        """The whole model's weights in the one-rank layout of its backend (Megatron names for
        Megatron-core), gathered from the cell's ranks when the model is split."""
        whole = self._cell.whole_weights()
        assert whole is not None
        return whole

    def hf_weights(self) -> dict[str, torch.Tensor]:
        """The whole model in the transformers layout engines load (gathered from the tensor-parallel and
        pipeline ranks, converted with gyre-xfer's `megatron_to_hf` for Megatron-core), in the model's
        dtype."""
        whole = self.whole_weights()
        if self.model_cfg.backend != "megatron":
            return whole
        return megatron_hf(whole, self.model_cfg)

    def load_whole_weights(self, whole: dict[str, torch.Tensor]) -> int:
        """Load whole-model weights in the one-rank layout (what `whole_weights` returns; for
        Megatron-core, a one-rank Megatron state dict) into every rank's part, keep the AdamW state, and
        publish them; returns the new snapshot. Refused while a step is accepted."""
        if self._queue.steps():
            raise RuntimeError("load weights with no step accepted")
        with self._updating:
            self._cell.load_whole(whole)
        return self.republish()

    def gradient(
        self, microbatches: Sequence[PackedBatch], on_progress: Callable[[int], None] | None = None
    ) -> GradientResult:
        """The loss and the summed gradient of a mini-batch, computed as a step would be (the core and
        every admitted satellite claim its micro-batches; each gradient rounded to the wire dtype and
        summed in order), made whole on rank 0 in the one-rank layout, and not applied: weights, AdamW
        state and the trainer's position stay as they are. For checking a cell against one rank."""
        self.check(microbatches)
        self._queue.begin_local(microbatches)
        try:
            self._compute_until_complete(on_progress)
            res = self._queue.finish()
        except BaseException:
            self._queue.abort()
            raise
        self._queue.dropped()  # not applied: the queue's position stays, for the feeders' steps
        whole = self._cell.whole_gradient(res.batch, len(res.microbatches))
        assert whole is not None
        m = [res.metrics[i] for i in sorted(res.metrics)]
        return GradientResult(
            loss=float(sum(x.get("loss", 0.0) for x in m)),
            gradient=whole,
            compute_s=float(sum(x.get("compute_s", 0.0) + x.get("copy_s", 0.0) for x in m)),
            tokens=sum(b.num_tokens for b in res.microbatches),
        )

    def push_to_engines(self) -> PushReport:
        """Push the current weights (transformers layout) to the engines of `CoreConfig.engines`, labelled
        with the core's version. Called after every update; call it again to retry a failed push (after
        `engine_sync.reconnect()` if the group broke)."""
        if self.engine_sync is None:
            raise WeightSyncError("no engines configured (CoreConfig.engines)")
        try:
            self.last_push = self.engine_sync.push(self.hf_weights(), self.version)
        except WeightSyncError as exc:
            raise WeightSyncError(
                f"step {self.step} is applied (version {self.version}, snapshot {self.snapshot}), but the "
                f"engines did not get it: {exc}"
            ) from exc
        return self.last_push

    # ---- state -------------------------------------------------------------------------------------

    def state_dict(self) -> TrainerState:
        """Everything a resumed core needs: weights and AdamW state by parameter name, step, version and
        queue position, the layout digest and the model configuration, as of the last applied update. It
        may be taken while a step trains or is open: such steps are not in it (their micro-batches and
        partial gradient are dropped; the resumed core expects the feeder to give them again from
        `queue_position`). Tensors are the live ones (detached): copy them before training on if you
        keep them. A cell whose model is split over tensor-parallel ranks gives the one-rank model's
        state (its weights and AdamW moments gathered onto rank 0, the one-rank layout's digest), which a
        one-rank core loads as well; one split over pipeline stages is refused (`CheckpointError`);
        data-parallel copies are the same as rank 0."""
        self._refuse_split("checkpoints")
        with self._updating:
            return self._split_state_dict() if self._split else self._state_dict()

    @property
    def _split(self) -> bool:
        return self.cell is not None and self.cell.megatron

    def _refuse_split(self, what: str) -> None:
        if self._split and self.cell is not None and self.cell.cfg.pp != 1:
            raise CheckpointError(
                f"{what} of a cell whose model is split over pipeline stages (tp {self.cell.cfg.tp}, pp "
                f"{self.cell.cfg.pp}) are not done: a stage does not know the others' layout"
            )

    def _split_state_dict(self) -> TrainerState:
        """The one-rank model's state gathered from the ranks' parts (collective; rank 0 keeps it)."""
        from gyre_train import mplayout

        model = self._cell.whole_weights()
        moments = {k: self._cell.whole_moment(k) or {} for k in MOMENTS}
        assert model is not None
        by_name = {
            n: {"step": torch.as_tensor(st["step"]).detach(), **{k: moments[k][n] for k in MOMENTS}}
            for n, p in self.model.named_parameters()
            if (st := self.optimizer.state.get(p))
        }
        groups = [
            {k: v for k, v in g.items() if k != "params"} for g in self.optimizer.state_dict()["param_groups"]
        ]
        return TrainerState(
            model=model,
            optimizer=OptimizerState(state=by_name, param_groups=groups),
            position=self._queue.state_dict(),
            layout=mplayout.whole_digest(self.model),
            model_config=self.model_cfg.to_dict(),
        )

    def _state_dict(self) -> TrainerState:
        names = {id(p): n for n, p in self.model.named_parameters()}
        opt = self.optimizer.state_dict()
        groups = [{k: v for k, v in g.items() if k != "params"} for g in opt["param_groups"]]
        by_name = {
            names[id(p)]: {k: torch.as_tensor(v).detach() for k, v in st.items()}
            for p, st in self.optimizer.state.items()
        }
        return TrainerState(
            model={n: p.detach() for n, p in self.model.named_parameters()},
            optimizer=OptimizerState(state=by_name, param_groups=groups),
            position=self._queue.state_dict(),
            layout=self.layout.digest,
            model_config=self.model_cfg.to_dict(),
        )

    def load_state_dict(self, state: TrainerState) -> None:
        """Resume from `state_dict()`'s output (same architecture and optimizer; CheckpointError if the
        layout differs; RuntimeError while any step is accepted), then publish the loaded weights as a
        new snapshot (on a data-parallel cell, every copy gets the loaded weights and AdamW state; on a
        tensor-parallel cell, every rank its part of the one-rank state)."""
        self._refuse_split("checkpoints")
        if self._split:
            self._load_split(state)
            return
        if state["layout"] != self.layout.digest:
            raise CheckpointError(
                f"parameter layout {state['layout']} differs from the model's {self.layout.digest}"
            )
        ps = dict(self.model.named_parameters())
        unknown = set(state["optimizer"]["state"]) - set(ps)
        if set(state["model"]) != set(ps) or unknown:
            raise CheckpointError(
                f"parameter names differ: {sorted(set(state['model']) ^ set(ps) | unknown)[:5]}"
            )
        index = {n: i for i, n in enumerate(ps)}
        sd = self.optimizer.state_dict()
        for g, saved in zip(sd["param_groups"], state["optimizer"]["param_groups"], strict=True):
            g.update(saved)
        self._queue.load_state_dict(state["position"])
        with torch.no_grad():
            for n, p in ps.items():
                p.copy_(state["model"][n])
        self.optimizer.load_state_dict(
            {
                "state": {index[n]: dict(st) for n, st in state["optimizer"]["state"].items()},
                "param_groups": sd["param_groups"],
            }
        )
        self._cell.sync_state()
        self.republish()

    def _load_split(self, state: TrainerState) -> None:
        """`load_state_dict` on a tensor-parallel cell: the one-rank state into every rank's part. The
        hyper-parameters are each rank's configuration (the same on every rank): a state with others is
        refused, as is one whose parameters differ in their AdamW step counts."""
        from gyre_train import mplayout

        digest = mplayout.whole_digest(self.model)
        if state["layout"] != digest:
            raise CheckpointError(f"parameter layout {state['layout']} differs from the model's {digest}")
        names = set(mplayout.global_names(self.model).values())
        opt = state["optimizer"]["state"]
        if set(state["model"]) != names or (opt and set(opt) != names):
            raise CheckpointError(f"parameter names differ: {sorted(set(state['model']) ^ names)[:5]}")
        mine = [
            {k: v for k, v in g.items() if k != "params"} for g in self.optimizer.state_dict()["param_groups"]
        ]
        if msgspec.json.encode(mine) != msgspec.json.encode(state["optimizer"]["param_groups"]):
            raise CheckpointError(
                f"optimizer settings {state['optimizer']['param_groups']} differ from this core's {mine}: a "
                "split core takes its settings from its configuration"
            )
        steps = {float(st["step"]) for st in opt.values()}
        if len(steps) > 1:
            raise CheckpointError(f"parameters at different AdamW step counts {sorted(steps)[:5]}")
        if self._queue.steps():
            raise RuntimeError("load a checkpoint with no step accepted")
        with self._updating:
            self._queue.load_state_dict(state["position"])
            self._cell.load_whole(state["model"])
            if opt:
                (step,) = steps
                for key in MOMENTS:
                    self._cell.load_whole_moment(key, {n: st[key] for n, st in opt.items()}, step)
        self.republish()

    def save(self, path: Path) -> Path:
        """Checkpoint `state_dict()` to directory `path` (at any time; see `state_dict`)."""
        return checkpoint.save(self.state_dict(), path)

    def load(self, path: Path) -> None:
        """Resume from a checkpoint written by `save` (same model architecture and optimizer)."""
        try:
            self.load_state_dict(checkpoint.load(path))
        except CheckpointError as exc:
            raise CheckpointError(f"{path}: {exc}") from exc

    def close(self) -> None:
        if getattr(self, "engine_sync", None) is not None:
            sync, self.engine_sync = self.engine_sync, None
            assert sync is not None
            sync.close()
        self._server.close()
        self._cell.close()


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
