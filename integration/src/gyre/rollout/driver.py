"""The rollout driver: runs batches of harness executions through the proxy, with hard timeouts.

Batch k (`queries` tasks x `group_size` executions) starts when gyre-sched's admission rule allows
(`gyre_sched.policy.batches_to_start` with the policy's `Admission`, which the scheduler's `Welcome`
names, the steps the trainer has applied and `max_ahead`): ROLLING policies start a batch once at most
`max_ahead` applied steps separate it from the trainer; the report's Colocate (COHORT) starts a cohort of
batches together, and the next cohort only once every started batch is trained. Nothing starts before
the `Welcome`. Each execution runs the configured harness (`harnesses.py`: the built-in agent, Claude
Code or a command) under `asyncio.wait_for` with the execution timeout; when it ends (finished, timed
out, or failed) the harness scores it and the score goes to the trajectory service with the number of
calls that completed. Nominal durations come from
gyre-sched's `sample_durations` on the same workload the simulator predicts, so both see one sample.
The driver reports the water level (`WaterLevel`: unfinished executions, their ages, finished
durations and timeout flags, and whether the admission rule holds a batch back) to gyre-sched every
`report_s`. A resumed run (`gyre run --resume`) starts at batch `first_step` (the checkpoint's queue
position), drawing the earlier batches' tasks without running them (the same tasks as the first
attempt), and names its groups `s<k>-q<q>-a<attempt>` so that executions run again never share an id
with an abandoned one in the record log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import zmq
from gyre_sched.client import dealer
from gyre_sched.policy import batches_to_start
from gyre_sched.protocol import (
    Admission,
    Codec,
    Hello,
    PeerKind,
    ProtocolError,
    Reject,
    WaterLevel,
    Welcome,
)

from gyre.config.runconfig import Config
from gyre.rollout.agents.agent import HarnessError
from gyre.rollout.harnesses import Run, make_harness
from gyre.trajsvc.service import TrajectoryService

log = logging.getLogger("gyre.driver")


class NoWelcome(RuntimeError):
    """gyre-sched did not welcome the driver (no answer in time, or a refusal)."""


@dataclass
class Outcome:
    execution_id: str
    step: int
    start: float
    end: float
    calls: int
    timed_out: bool
    score: float | None
    tool_s: float = 0.0
    """Tool time the harness slept (the rest of the wall time went to model calls and waiting)."""
    error: str = ""
    tools: dict[str, int] = field(default_factory=dict)
    """Tool calls the task needed, by who made them: model, script (fallback) or missed."""
    where: tuple[int, int, int] = (0, 0, 0)
    """Its place in the run: (batch, query, index in the group)."""


@dataclass
class DriverState:
    running: dict[str, float] = field(default_factory=dict)
    """execution id -> start (monotonic)."""
    finished: list[tuple[float, bool]] = field(default_factory=list)
    """(wall duration, timed out) since the last report."""
    outcomes: list[Outcome] = field(default_factory=list)
    batches_started: dict[int, float] = field(default_factory=dict)


class Driver:
    def __init__(
        self,
        cfg: Config,
        proxy_url: str,
        sched_address: str,
        traj: TrajectoryService,
        durations: np.ndarray,
        *,
        first_step: int = 0,
        attempt: int = 0,
    ) -> None:
        self.cfg = cfg
        self.proxy_url = proxy_url
        self.sched_address = sched_address
        self.traj = traj
        self.durations = durations
        self.first_step = first_step
        self.attempt = attempt
        self.state = DriverState()
        self.harness = make_harness(cfg)
        """Runs and scores each execution (`[agent] harness`: harnesses.py)."""
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.admission: Admission | None = None
        """When batches may start: from the scheduler's `Welcome` (None until it arrives)."""
        self.admission_held = False
        """A batch is left to start that the admission bound holds back until the next step is applied
        (reported in the water level: elastic's core trains that step at once)."""
        self._welcomed = threading.Event()
        self._refused = ""
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._loop, name="driver", daemon=True),
            threading.Thread(target=self._report, name="water-level", daemon=True),
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30.0)

    def _loop(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:
            log.exception("driver failed")
            self.error = exc
        finally:
            self.done.set()

    async def _main(self) -> None:
        c = self.cfg
        rng = random.Random(c.run.seed)
        # uncapped: an execution cancelled at its timeout while waiting for a slot of a capped pool leaks
        # that slot for good (httpx 0.28 / httpcore 1.0.9); the executions in flight bound the connections
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=100)
        timeout = httpx.Timeout(c.agent.request_timeout_s, connect=5.0)
        admission = await self._welcome()
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
            batches: list[asyncio.Task[None]] = []
            for skipped in range(self.first_step):  # applied before a crash: their tasks are drawn
                for q in range(c.batch.queries):
                    self.harness.task(rng, self._group_id(skipped, q))
            k = self.first_step
            while k < c.run.steps:
                n = batches_to_start(
                    admission, started=k, trained=self.traj.applied, max_ahead=c.driver.max_ahead
                )
                self.admission_held = n <= 0
                if n <= 0:
                    if self._stop.is_set():
                        return
                    await asyncio.sleep(0.05)
                    continue
                for _ in range(min(n, c.run.steps - k)):
                    batches.append(asyncio.create_task(self._batch(http, rng, k)))
                    await asyncio.sleep(0)  # batch k registers (and draws its tasks) before k+1
                    k += 1
            self.admission_held = False  # every batch started
            work = asyncio.gather(*batches)
            while not work.done():
                if self._stop.is_set():  # the run stopped (its deadline): executions in flight end now,
                    work.cancel()  # as at their timeout, rather than keeping stop() waiting for them
                    with contextlib.suppress(asyncio.CancelledError):
                        await work
                    return
                await asyncio.wait({work}, timeout=0.05)
            await work

    async def _welcome(self) -> Admission:
        """The policy's admission, once the scheduler has welcomed the water-level socket."""
        deadline = time.monotonic() + self.cfg.run.startup_timeout_s
        while not self._welcomed.is_set():
            if self._refused:
                raise NoWelcome(f"gyre-sched refused the driver: {self._refused}")
            if time.monotonic() > deadline or self._stop.is_set():
                raise NoWelcome(
                    f"no Welcome from gyre-sched at {self.sched_address} within "
                    f"{self.cfg.run.startup_timeout_s:.0f} s ([run] startup_timeout_s)"
                )
            await asyncio.sleep(0.02)
        assert self.admission is not None
        log.info("gyre-sched welcomed the driver: %s admission", self.admission.name)
        return self.admission

    async def _batch(self, http: httpx.AsyncClient, rng: random.Random, k: int) -> None:
        c = self.cfg
        groups: dict[str, list[str]] = {}
        runs = []
        for q in range(c.batch.queries):
            gid = self._group_id(k, q)
            task = self.harness.task(rng, gid)
            groups[gid] = []
            for j in range(c.batch.group_size):
                eid = f"{gid}-e{j}"
                groups[gid].append(eid)
                tool_s = float(self.durations[k, q, j]) * (1.0 - c.agent.model_fraction)
                runs.append((self.harness.execution(eid, gid, task, tool_s, (k, q, j)), (k, q, j)))
        self.traj.register_batch(k, groups)
        with self.lock:
            self.state.batches_started[k] = time.time()
        log.info("batch %d started: %d executions", k, len(runs))
        await asyncio.gather(*(self._one(http, k, ex, where) for ex, where in runs))

    def _group_id(self, k: int, q: int) -> str:
        return f"s{k}-q{q}" + (f"-a{self.attempt}" if self.attempt else "")

    async def _one(self, http: httpx.AsyncClient, k: int, ex: Run, where: tuple[int, int, int]) -> None:
        c = self.cfg
        t0 = time.monotonic()
        start = time.time()
        with self.lock:
            self.state.running[ex.execution_id] = t0
        timed_out, error = False, ""
        try:
            await asyncio.wait_for(self.harness.run(http, self.proxy_url, ex), timeout=c.agent.timeout_s)
        except TimeoutError:
            timed_out = True
        except (HarnessError, httpx.HTTPError, OSError) as exc:
            error = f"{type(exc).__name__}: {exc}"
            log.warning("execution %s failed: %s", ex.execution_id, error)
        dur, end = time.monotonic() - t0, time.time()  # it ended here, before its score goes anywhere
        await self.harness.settle(ex, self.traj.recorded_calls)
        score = await self.harness.score(ex, timed_out, error)
        self.traj.score(k, score, ex.calls)
        with self.lock:
            self.state.running.pop(ex.execution_id, None)
            self.state.finished.append((dur, timed_out))
            self.state.outcomes.append(
                Outcome(
                    ex.execution_id,
                    k,
                    start,
                    end,
                    ex.calls,
                    timed_out,
                    score.value,
                    ex.tool_s,
                    error,
                    ex.tool_calls(),
                    where,
                )
            )

    def track(self, execution_id: str) -> None:
        """Count an execution run outside the driver (an evaluation) in the water level until `untrack`."""
        with self.lock:
            self.state.running[execution_id] = time.monotonic()

    def untrack(self, execution_id: str, timed_out: bool = False) -> None:
        with self.lock:
            t0 = self.state.running.pop(execution_id, None)
            if t0 is not None:
                self.state.finished.append((time.monotonic() - t0, timed_out))

    def _report(self) -> None:
        codec = Codec()
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sock = dealer(ctx, self.sched_address)  # with the run token ($GYRE_TOKEN) when there is one
        hello = codec.encode(Hello(PeerKind.DRIVER))
        try:
            while not self._stop.is_set():
                # Never blocks: with no scheduler to queue for (not reachable, or its handshake refused
                # this socket) a report is dropped, the next one follows, and stop() is not kept waiting.
                with contextlib.suppress(zmq.Again):
                    if hello:
                        sock.send(hello, zmq.NOBLOCK)
                        hello = b""
                    sock.send(codec.encode(self.water_level()), zmq.NOBLOCK)
                while sock.poll(0):
                    try:
                        self._heard(codec.decode(sock.recv()))
                    except ProtocolError as exc:  # dropped; the scheduler is ours, so log it
                        log.warning("undecodable message from gyre-sched: %s", exc)
                self._stop.wait(self.cfg.driver.report_s)
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sock.close(0)
            ctx.term()

    def _heard(self, msg: object) -> None:
        if isinstance(msg, Welcome) and not self._welcomed.is_set():
            self.admission = msg.admission
            self._welcomed.set()
        elif isinstance(msg, Reject):
            log.warning("gyre-sched: %s", msg.reason)
            if not self._welcomed.is_set():
                self._refused = msg.reason

    def water_level(self) -> WaterLevel:
        now = time.monotonic()
        with self.lock:
            ages = [now - t for t in self.state.running.values()]
            fin, self.state.finished = self.state.finished, []
        buckets: dict[float, int] = {}
        for a in ages:
            b = float(np.floor(a))
            buckets[b] = buckets.get(b, 0) + 1
        keys = sorted(buckets)
        return WaterLevel(
            unfinished=len(ages),
            elapsed_s=tuple(keys),
            elapsed_count=tuple(buckets[b] for b in keys),
            finished_s=tuple(d for d, _ in fin),
            finished_timeout=tuple(t for _, t in fin),
            admission_held=self.admission_held,
        )

    def outcomes(self) -> list[dict[str, Any]]:
        """Each execution's outcome as the plain JSON types metrics.json holds (its place as a list)."""
        with self.lock:
            return [{**o.__dict__, "where": list(o.where)} for o in self.state.outcomes]
