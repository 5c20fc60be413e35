"""A satellite replica: weights only, no optimizer. Started once, it says hello to the core, builds the
model, allocates everything a join needs (page-locked snapshot staging, the gradient staging region
registered with its gyre-xfer transport), pulls the current snapshot and computes warm-up micro-batches
(kernels compiled, memory allocated), and only then long-polls for work. When the core admits it, each
assignment names the weight version to compute at; the satellite pulls that gyre-xfer snapshot into its
staging and copies it into the parameters (one host-to-device copy per tensor on a GPU), computes the
gradient straight into its gradient staging in the core's wire dtype, and sends a `Gradient` header
naming the buckets; the core reads them over gyre-xfer (Mooncake, or shared memory on one host) and acks.

A satellite may be a multi-rank cell of the core's shape (`cell.py`): the `Satellite` is rank 0's, it
claims one micro-batch per data-parallel copy for each round, every rank pulls the snapshot of the
matching core rank and computes its part (`satcell.py`; the other ranks run `follower.follow`), and the
header names each rank's slice for the core rank of the same number. A one-rank satellite beside a
multi-rank core (of one pipeline stage) pulls the whole model's weights (the core's `whole_publisher`)
and hands its whole gradient, of which every core rank takes its own part; other shapes are refused at
hello (`satellite_refusal` names both).

Every wait has a deadline: a core that does not answer within `reply_timeout_s` is an error, not a hang.
The satellite connects with the run token (`SatelliteConfig.token`, else `$GYRE_TOKEN`; gyre-xfer
`auth`): a core with a token answers only holders of the same one, so a satellite without it gets no
answer and its hello ends in `CoreGoneError`.
A heartbeat thread (its own socket) keeps the core from declaring a busy satellite dead.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
from gyre_base.sockets import connected
from gyre_base.token import TOKEN_ENV
from gyre_traj.loss import LossConfig

from gyre_train.cell import Cell
from gyre_train.claimqueue import Assignment
from gyre_train.defaults import warmup_rounds
from gyre_train.devmem import release_cached_memory
from gyre_train.model import Attention, ModelConfig, build_model
from gyre_train.protocol import (
    PROTOCOL,
    Ack,
    Assign,
    CellShape,
    Claim,
    ErrorCode,
    ErrorReply,
    Goodbye,
    Gradient,
    Heartbeat,
    Hello,
    Idle,
    RankSetup,
    Reply,
    Shutdown,
    Welcome,
    reply_decoder,
    satellite_refusal,
)
from gyre_train.satcell import SatCell
from gyre_train.satrank import SatelliteRank, SatWork, SnapshotMismatchError
from gyre_train.threads import start_thread
from gyre_train.wire import from_frames, microbatch_arrays, microbatch_from_arrays, to_frames


class CoreGoneError(RuntimeError):
    """The core did not answer within the deadline, or refused this satellite."""


@dataclass(frozen=True)
class SatelliteConfig:
    core: str
    """The core's ROUTER address (Core.address)."""
    name: str
    """Replica name, unique among the core's satellites."""
    device: str = "cpu"
    reply_timeout_s: float = 30.0
    """Deadline for any reply from the core."""
    hello_timeout_s: float = 120.0
    """Deadline for the core to answer the first hello (it may still be starting)."""
    idle_exit_s: float = 0.0
    """Exit after this long without work (0 = wait for the core's Shutdown)."""
    warmup: int | None = None
    """Synthetic micro-batches (of different lengths) computed at start, before the first claim, so that
    kernels are compiled (FlexAttention) and memory allocated before any join. None = 2 on a GPU, 0 on
    the CPU."""
    verify_shm_checksums: bool = False
    """crc32 every tensor of a snapshot pulled over same-host shared memory (a memcpy between mappings;
    the crc costs about 0.6 s per GB of CPU). Pulls over Mooncake (TCP/RDMA) are always verified."""
    crash_after_claims: int = 0
    """Fault injection for tests: SIGKILL this process right after receiving its N-th micro-batch
    (0 = never), so the core sees a real death mid-batch."""
    vanish_after_claims: int = 0
    """Fault injection for tests with satellites as threads: right after receiving its N-th micro-batch,
    go silent as a dead process would (no gradient, no goodbye, heartbeats stop) and return from `run`
    (0 = never)."""
    token: str = field(default="", repr=False)
    """The core's run token; empty: $GYRE_TOKEN, or none."""


class Satellite:
    def __init__(self, cfg: SatelliteConfig, cell: Cell | None = None) -> None:
        """`cell`: a multi-rank satellite (this is its rank 0; the other ranks run
        `follower.follow(cell)` and build their parts when this constructor tells them to)."""
        if cell is not None and cell.rank != 0:
            raise ValueError(
                f"the Satellite runs on rank 0 of its cell; rank {cell.rank} runs follower.follow(cell)"
            )
        self.cfg = cfg
        self.cell = cell
        self.shape = cell.cfg.shape if cell is not None else CellShape()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock = connected(self._ctx, zmq.DEALER, cfg.core, cfg.token)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = reply_decoder()
        try:
            self.welcome = w = self._hello()
        except BaseException:
            self._sock.close(0)
            self._ctx.term()
            raise
        self._stop = threading.Event()
        self._beat = start_thread(self._heartbeat, "gyre-train-heartbeat")  # its death ends the process
        self.loss = msgspec.json.decode(w.loss, type=LossConfig)
        self.model_cfg = ModelConfig.from_json(w.model_config)
        if w.attention not in ("dense", "flex"):
            raise CoreGoneError(f"core asks for unknown attention {w.attention!r}")
        self.attention: Attention = "flex" if w.attention == "flex" else "dense"
        device = str(cell.device(cfg.device)) if cell is not None else cfg.device
        self.model = build_model(self.model_cfg, self.attention, device)
        verify = w.transport != "shm" or cfg.verify_shm_checksums
        work = SatWork(
            self.loss,
            self.attention,
            w.chunk_budget,
            w.transport,
            w.wire_dtype,
            w.bucket_bytes,
            w.publishers[0] if self.shape == w.cell else w.whole_publisher,
            verify,
            cfg.token,
        )
        rank0 = SatelliteRank(self.model, work, cell)
        setup = RankSetup(
            "satellite",
            w.model_config,
            w.loss,
            w.attention,
            w.chunk_budget,
            rank0.device.type,
            w.transport,
            w.wire_dtype,
            w.bucket_bytes,
            publishers=w.publishers,
            verify_checksums=verify,
        )
        try:
            self._cell = SatCell(rank0, cell, setup if cell is not None else None)
        except BaseException:
            rank0.close()
            raise
        self.layout = rank0.layout
        self.version = -1
        self.claims = 0
        self.released_bytes = 0
        """Device memory given back to the driver when the core had no work for this replica (`devmem`)."""
        self.rejoins = 0
        rounds = cfg.warmup if cfg.warmup is not None else warmup_rounds(rank0.device.type)
        self.warmup_s = self._warm_up(rounds)

    def _hello(self) -> Welcome:
        w = self._request(Hello(PROTOCOL, self.cfg.name, self.shape), timeout_s=self.cfg.hello_timeout_s)
        if not isinstance(w, Welcome):
            raise CoreGoneError(f"core refused hello: {w}")
        refusal = satellite_refusal(self.shape, w.cell)
        if refusal is not None:
            raise CoreGoneError(refusal)
        if len(w.publishers) != w.cell.world or (self.shape != w.cell and not w.whole_publisher):
            raise CoreGoneError(
                f"core cell of {w.cell} with {len(w.publishers)} publishers "
                f"(whole-model publisher {w.whole_publisher!r}); this cell is {self.shape}"
            )
        return w

    @property
    def snapshot(self) -> int:
        """The snapshot the weights come from (-1 before the first pull)."""
        return self._cell.rank0.snapshot

    def _request(
        self, req: Any, frames: list[Any] | None = None, timeout_s: float | None = None
    ) -> tuple[Reply, list[Any]] | Reply:
        self._sock.send_multipart([self._enc.encode(req), *(frames or [])], copy=False)
        limit = self.cfg.reply_timeout_s if timeout_s is None else timeout_s
        if not self._sock.poll(int(limit * 1000)):
            raise CoreGoneError(
                f"core at {self.cfg.core} did not answer within {limit} s (a core with a run token "
                f"answers only satellites holding the same one: {TOKEN_ENV} or --token-file)"
            )
        msg = self._sock.recv_multipart(copy=False)
        rep = self._dec.decode(msg[0].buffer)
        if isinstance(rep, ErrorReply):
            if rep.code == ErrorCode.UNKNOWN_REPLICA and isinstance(req, Claim | Gradient):
                return rep  # the core presumed us dead while we were silent: say hello again
            raise CoreGoneError(f"core error {rep.code.name}: {rep.message}")
        if isinstance(rep, Assign):
            return rep, msg[1:]
        return rep

    def _heartbeat(self) -> None:
        sock = connected(self._ctx, zmq.DEALER, self.cfg.core, self.cfg.token)
        enc = msgspec.msgpack.Encoder()
        try:
            while not self._stop.wait(self.welcome.heartbeat_s):
                sock.send(enc.encode(Heartbeat(self.cfg.name)), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        finally:
            sock.close()

    def _warm_up(self, n: int) -> float:
        """At start, not at a join: pull the current snapshot (maps the publisher's segment, registers the
        staging) and compute `n` rounds of synthetic micro-batches of different lengths (compiles the
        attention kernels for dynamic shapes, runs the chunked path once where the core chunks). Their
        gradients are thrown away, and the allocator's idle blocks go back to the driver after, as the
        core's do: a rollout engine on the same GPU starts beside this replica (on an H200 a 32k-token
        warm-up left 58 GiB reserved, and both engines then ran out of memory)."""
        if n <= 0:
            return 0.0
        from gyre_train.data import warmup_microbatches

        t0 = time.perf_counter()
        self.pull(-1)
        chunk = self.welcome.chunk_budget  # with chunking on, a micro-batch above it is computed too
        budget = 2 * chunk if chunk else 1 << 14
        for k in range(n):
            per_rank = [  # lengths differ by seed
                warmup_microbatches(1000 + k * self.shape.dp + j, self.model_cfg.vocab_size, budget, chunk)
                for j in range(self.shape.dp)
            ]
            for i in range(min(len(mbs) for mbs in per_rank)):
                fake = []
                for j, mbs in enumerate(per_rank):
                    specs, frames = to_frames(microbatch_arrays(mbs[i]))
                    fake.append(Assignment(-1, j, -1, -1, mbs[i], specs, frames))
                self._cell.compute(fake)
        self.released_bytes += release_cached_memory()
        return time.perf_counter() - t0

    def pull(self, snapshot: int) -> float:
        """Every rank pulls snapshot `snapshot` (-1: the newest) of its core rank into its parameters;
        returns the seconds taken (the slowest rank's)."""
        try:
            return self._cell.pull(snapshot)
        except SnapshotMismatchError as exc:
            raise CoreGoneError(str(exc)) from exc

    def _rejoin(self) -> bool:
        """Say hello again after the core presumed us dead; False if the core is shutting down."""
        rep = self._request(Hello(PROTOCOL, self.cfg.name))
        if isinstance(rep, Shutdown):
            return False
        if not isinstance(rep, Welcome):
            raise CoreGoneError(f"core answered a second hello with {type(rep).__name__}")
        self.rejoins += 1
        return True

    def _claim_round(self) -> list[Assignment] | Reply:
        """Claim one micro-batch (long poll), then up to one more per other data-parallel copy without
        waiting; or the reply that ended the claim (Shutdown, Idle, ErrorReply)."""
        out: list[Assignment] = []
        while len(out) < self.shape.dp:
            got = self._request(Claim(self.cfg.name, self.version, hold=not out))
            if not isinstance(got, tuple):
                if out and isinstance(got, Idle):
                    break
                return got
            a, frames = got
            assert isinstance(a, Assign)
            mb = microbatch_from_arrays(from_frames(a.arrays, frames))
            out.append(Assignment(a.batch, a.index, a.version, a.snapshot, mb, a.arrays, frames))
        return out

    def run(self) -> int:
        """Serve until the core says Shutdown (or `idle_exit_s` passes without work); returns the number
        of micro-batches computed."""
        done = 0
        done_since_idle = 0
        idle_since = time.monotonic()
        while True:
            got = self._claim_round()
            if isinstance(got, Shutdown):
                break
            if isinstance(got, ErrorReply):  # presumed dead: register again (same process, same model)
                if not self._rejoin():
                    break
                continue
            if isinstance(got, Idle):
                if done_since_idle:  # dismissed or between steps: the rollout engine beside may need it
                    self.released_bytes += release_cached_memory()
                    done_since_idle = 0
                if self.cfg.idle_exit_s and time.monotonic() - idle_since > self.cfg.idle_exit_s:
                    self._request(Goodbye(self.cfg.name))
                    break
                continue
            if not isinstance(got, list):
                raise CoreGoneError(f"unexpected reply {got}")
            self.claims += len(got)
            if self.cfg.crash_after_claims and self.claims >= self.cfg.crash_after_claims:
                os.kill(os.getpid(), signal.SIGKILL)
            if self.cfg.vanish_after_claims and self.claims >= self.cfg.vanish_after_claims:
                self._stop.set()  # the heartbeat thread ends: the core will presume this replica dead
                return done
            accepted = self._compute_and_hand_over(got)
            if accepted < 0:  # presumed dead while computing and the core is shutting down
                break
            done += accepted
            done_since_idle += len(got)
            idle_since = time.monotonic()
        return done

    def _compute_and_hand_over(self, round_: list[Assignment]) -> int:
        """Compute a round and send each gradient's header; the number the core accepted (-1: the core
        is shutting down)."""
        a0 = round_[0]
        pull_s = self.pull(a0.snapshot) if self.snapshot != a0.snapshot else 0.0
        self.version = a0.version
        accepted = 0
        for a, (metrics, shards) in zip(round_, self._cell.compute(round_), strict=True):
            metrics["pull_s"] = pull_s
            ack = self._request(Gradient(self.cfg.name, a.batch, a.index, a.version, shards, metrics))
            if isinstance(ack, ErrorReply):  # presumed dead while computing: the claims were re-queued
                return accepted if self._rejoin() else -1
            if not isinstance(ack, Ack):
                raise CoreGoneError(f"expected an ack, got {ack}")
            accepted += int(ack.accepted)  # refused: another step by now, or the transfer failed (re-queued)
        return accepted

    def close(self) -> None:
        self._stop.set()
        self._beat.join(timeout=5.0)
        self._cell.close()
        self._sock.close()
        self._ctx.term()
