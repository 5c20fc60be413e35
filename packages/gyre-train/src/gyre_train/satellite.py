"""A satellite replica: weights only, no optimizer. Started once, it says hello to the core, builds the
model, allocates everything a join needs (page-locked snapshot staging, the gradient staging region
registered with its gyre-xfer transport), pulls the current snapshot and computes warm-up micro-batches
(kernels compiled, memory allocated), and only then long-polls for work. When the core admits it, each
assignment names the weight version to compute at; the satellite pulls that gyre-xfer snapshot into its
staging and copies it into the parameters (one host-to-device copy per tensor on a GPU), computes the
gradient straight into its gradient staging in the core's wire dtype, and sends a `Gradient` header
naming the buckets; the core reads them over gyre-xfer (Mooncake, or shared memory on one host) and acks.

Every wait has a deadline: a core that does not answer within `reply_timeout_s` is an error, not a hang.
A heartbeat thread (its own socket) keeps the core from declaring a busy satellite dead.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
import zmq
from gyre_traj.loss import LossConfig
from gyre_xfer.sockets import make_socket
from gyre_xfer.subscriber import Subscriber, SubscriberConfig
from gyre_xfer.transport import Config as XferConfig
from gyre_xfer.transport import open_transport

from gyre_train.handoff import GradStaging
from gyre_train.model import Attention, Layout, ModelConfig, build_model, micro_gradient, params
from gyre_train.protocol import (
    PROTOCOL,
    Ack,
    Assign,
    Claim,
    ErrorCode,
    ErrorReply,
    Goodbye,
    Gradient,
    Heartbeat,
    Hello,
    Idle,
    Reply,
    Shutdown,
    Welcome,
    reply_decoder,
)
from gyre_train.threads import start_thread
from gyre_train.wire import from_frames, microbatch_from_arrays


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


class Satellite:
    def __init__(self, cfg: SatelliteConfig) -> None:
        self.cfg = cfg
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock = make_socket(self._ctx, zmq.DEALER)
        self._sock.connect(cfg.core)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = reply_decoder()
        w = self._request(Hello(PROTOCOL, cfg.name), timeout_s=cfg.hello_timeout_s)
        if not isinstance(w, Welcome):
            raise CoreGoneError(f"core refused hello: {w}")
        self.welcome = w
        self._stop = threading.Event()
        self._beat = start_thread(self._heartbeat, "gyre-train-heartbeat")  # its death ends the process
        self.loss = msgspec.json.decode(w.loss, type=LossConfig)
        self.model_cfg = ModelConfig.from_json(w.model_config)
        if w.attention not in ("dense", "flex"):
            raise CoreGoneError(f"core asks for unknown attention {w.attention!r}")
        self.attention: Attention = "flex" if w.attention == "flex" else "dense"
        self.model = build_model(self.model_cfg, self.attention, cfg.device)
        self.layout = Layout.of(self.model)
        self._transport = open_transport(XferConfig(kind=w.transport))
        verify = w.transport != "shm" or cfg.verify_shm_checksums
        self._sub = Subscriber(
            self._transport, SubscriberConfig(publisher=w.publisher, verify_checksums=verify)
        )
        self.version = -1
        self.snapshot = -1
        self.claims = 0
        self.rejoins = 0
        ps = params(self.model)
        cuda = any(p.device.type == "cuda" for p in ps.values())
        # Page-locked staging for snapshot pulls, allocated once: a pull is a memcpy into it plus one
        # asynchronous host-to-device copy per tensor.
        self._staging: dict[str, torch.Tensor] | None = (
            {n: torch.empty(p.shape, dtype=p.dtype, pin_memory=True) for n, p in ps.items()} if cuda else None
        )
        # The gradient staging: a region registered with the transport, in the core's wire dtype, which the
        # core reads each gradient from (page-locked on a GPU: the gradient is copied in at full speed).
        self._staging_grad = GradStaging(
            self._transport, self.layout.numel, w.wire_dtype, bucket_bytes=w.bucket_bytes, pin=cuda
        )
        self._grad = self._staging_grad.slot(0)
        self.warmup_s = self._warm_up(cfg.warmup if cfg.warmup is not None else (2 if cuda else 0))

    def _request(
        self, req: Any, frames: list[Any] | None = None, timeout_s: float | None = None
    ) -> tuple[Reply, list[Any]] | Reply:
        self._sock.send_multipart([self._enc.encode(req), *(frames or [])], copy=False)
        limit = self.cfg.reply_timeout_s if timeout_s is None else timeout_s
        if not self._sock.poll(int(limit * 1000)):
            raise CoreGoneError(f"core at {self.cfg.core} did not answer within {limit} s")
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
        sock = make_socket(self._ctx, zmq.DEALER)
        sock.connect(self.cfg.core)
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
        staging) and compute `n` synthetic micro-batches of different lengths (compiles the attention
        kernels for dynamic shapes, fills the allocator). Their gradients are thrown away."""
        if n <= 0:
            return 0.0
        from gyre_train.data import synthetic_minibatch

        t0 = time.perf_counter()
        self.pull(-1)
        for k in range(n):
            mb = synthetic_minibatch(1, seed=1000 + k, token_budget=1 << 14)[0]  # lengths differ by seed
            micro_gradient(
                self.model, self.layout, mb, self.loss, self.attention, self._grad, self.welcome.chunk_budget
            )
        return time.perf_counter() - t0

    def pull(self, snapshot: int) -> float:
        """Pull snapshot `snapshot` (-1: the newest) into the parameters; returns the seconds taken."""
        t0 = time.perf_counter()
        ps = params(self.model)
        if self._staging is None:
            snap = self._sub.pull(min_version=max(snapshot, 0), into=ps)  # straight into the parameters
        else:  # accelerator: into page-locked staging (allocated at start), then one copy per tensor
            snap = self._sub.pull(min_version=max(snapshot, 0), into=self._staging)
            with torch.no_grad():
                for n, p in ps.items():
                    p.copy_(self._staging[n], non_blocking=True)
            torch.cuda.synchronize()
        if snapshot >= 0 and snap.version != snapshot:
            raise CoreGoneError(f"asked for snapshot {snapshot}, the publisher served {snap.version}")
        self.snapshot = snap.version
        return time.perf_counter() - t0

    def _rejoin(self) -> bool:
        """Say hello again after the core presumed us dead; False if the core is shutting down."""
        rep = self._request(Hello(PROTOCOL, self.cfg.name))
        if isinstance(rep, Shutdown):
            return False
        if not isinstance(rep, Welcome):
            raise CoreGoneError(f"core answered a second hello with {type(rep).__name__}")
        self.rejoins += 1
        return True

    def run(self) -> int:
        """Serve until the core says Shutdown (or `idle_exit_s` passes without work); returns the number
        of micro-batches computed."""
        done = 0
        idle_since = time.monotonic()
        while True:
            got = self._request(Claim(self.cfg.name, self.version))
            if isinstance(got, Shutdown):
                break
            if isinstance(got, ErrorReply):  # presumed dead: register again (same process, same model)
                if not self._rejoin():
                    break
                continue
            if isinstance(got, Idle):
                if self.cfg.idle_exit_s and time.monotonic() - idle_since > self.cfg.idle_exit_s:
                    self._request(Goodbye(self.cfg.name))
                    break
                continue
            if not isinstance(got, tuple):
                raise CoreGoneError(f"unexpected reply {got}")
            a, frames = got
            assert isinstance(a, Assign)
            self.claims += 1
            if self.cfg.crash_after_claims and self.claims >= self.cfg.crash_after_claims:
                os.kill(os.getpid(), signal.SIGKILL)
            if self.cfg.vanish_after_claims and self.claims >= self.cfg.vanish_after_claims:
                self._stop.set()  # the heartbeat thread ends: the core will presume this replica dead
                return done
            pull_s = 0.0
            if self.snapshot != a.snapshot:
                pull_s = self.pull(a.snapshot)
            self.version = a.version
            batch = microbatch_from_arrays(from_frames(a.arrays, frames))
            _, metrics = micro_gradient(
                self.model,
                self.layout,
                batch,
                self.loss,
                self.attention,
                self._grad,
                chunk_budget=self.welcome.chunk_budget,
            )
            metrics["pull_s"] = pull_s
            shards = (self._staging_grad.describe(0, rank=0),)
            ack = self._request(Gradient(self.cfg.name, a.batch, a.index, a.version, shards, metrics))
            if isinstance(ack, ErrorReply):  # presumed dead while computing: the claim was re-queued
                if not self._rejoin():
                    break
                continue
            if not isinstance(ack, Ack):
                raise CoreGoneError(f"expected an ack, got {ack}")
            done += int(ack.accepted)  # refused: another step by now, or the transfer failed (re-queued)
            idle_since = time.monotonic()
        return done

    def close(self) -> None:
        self._stop.set()
        self._beat.join(timeout=5.0)
        self._sub.close()
        self._staging_grad.close()
        self._transport.close()
        self._sock.close()
        self._ctx.term()
