"""The trajectory service: records in from gyre-proxy, trainable mini-batches out to gyre-train's core.

It PULLs the proxy's TITO records (ZeroMQ, msgpack) into a gyre-traj `Forest`, takes each execution's
`Score` from the driver, and when every group of step k is scored (and every call the harness saw
answered has arrived as a record) it selects (J_max), weights, tree-packs the step's executions and
submits them to the core as mini-batch k (`CoreClient.submit`, in queue order). Each execution goes into
exactly one mini-batch; a step with nothing trainable (every execution timed out before a call, say) is
submitted empty, and the core skips it. It reports `ReadyGroups` to gyre-sched: the groups ready and not yet applied, in step order
(with streaming, complete groups count as they finish; without, a step's groups count only once its
whole batch is complete; nothing after the first step still running counts, since steps are trained in
order), the trainer's version and whether a step is open.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq
from gyre_sched.protocol import Codec as SchedCodec
from gyre_sched.protocol import Hello, PeerKind, ReadyGroups
from gyre_train.control import CoreClient, InboxFull
from gyre_traj.io import Codec
from gyre_traj.pack import PackConfig, PackItem, pack
from gyre_traj.records import Call, EvalStatus, Score
from gyre_traj.select import SelectionConfig, select
from gyre_traj.tree import Forest
from gyre_traj.weights import group_advantages

log = logging.getLogger("gyre.trajsvc")


@dataclass
class StepData:
    step: int
    groups: dict[str, list[str]]
    """group id -> execution ids."""
    scores: dict[str, Score] = field(default_factory=dict)
    calls_expected: dict[str, int] = field(default_factory=dict)
    scored_at: float = 0.0
    submitted: bool = False
    summary: dict[str, Any] = field(default_factory=dict)


class TrajectoryService:
    def __init__(
        self,
        core_address: str,
        sched_address: str,
        batch_groups: int,
        *,
        streaming: bool,
        token_budget: int,
        j_max: int,
        report_s: float = 0.2,
        record_wait_s: float = 15.0,
    ) -> None:
        self.batch_groups = batch_groups
        self.streaming = streaming
        self.pack_cfg = PackConfig(token_budget=token_budget, mode="tree")
        self.sel_cfg = SelectionConfig(j_max=j_max or None)
        self.report_s = report_s
        self.record_wait_s = record_wait_s
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.RCVHWM, 100_000)
        port = self._pull.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self._sched_address = sched_address
        self._core_address = core_address
        self.forest = Forest()
        self.calls_seen: dict[str, int] = {}
        self.output_tokens: dict[str, int] = {}
        self.steps: dict[int, StepData] = {}
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._lock = threading.Lock()
        self.next_submit = 0
        self.applied = 0
        """Steps the core has applied (its queue position)."""
        self.version = 0
        self.records = 0
        self.error: BaseException | None = None
        self.hold_at: int | None = None
        """Steps from this one on are not submitted (an evaluation needs the version to stay put)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trajectory-service", daemon=True)

    # ---- what the driver calls (any thread) ---------------------------------------------------------
    def register_batch(self, step: int, groups: dict[str, list[str]]) -> None:
        self._inbox.put(("batch", (step, groups)))

    def score(self, step: int, score: Score, calls: int) -> None:
        self._inbox.put(("score", (step, score, calls)))

    def start(self) -> None:
        self._thread.start()

    def failure(self) -> str | None:
        """Why the service stopped working, once started (its error, or a thread that is gone), else None."""
        if self.error is not None:
            return f"{type(self.error).__name__}: {self.error}"
        if self._thread.ident is not None and not self._thread.is_alive() and not self._stop.is_set():
            return "its thread ended"
        return None

    def stop(self) -> None:
        """Stop the service thread (it closes the sockets); closes them itself if it never started."""
        self._stop.set()
        if self._thread.ident is None:
            self._pull.close(0)
            self._ctx.term()
            return
        self._thread.join(timeout=30.0)

    # ---- the service thread -------------------------------------------------------------------------
    def _run(self) -> None:
        codec = Codec()
        sc = SchedCodec()
        sched = self._ctx.socket(zmq.DEALER)
        sched.setsockopt(zmq.LINGER, 0)
        sched.connect(self._sched_address)
        sched.send(sc.encode(Hello(PeerKind.TRAJ)))
        core = CoreClient(self._core_address, timeout_s=30.0)
        last_report = 0.0
        try:
            while not self._stop.is_set():
                if self._pull.poll(20):
                    for _ in range(1000):
                        try:
                            data = self._pull.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._record(codec.decode_msgpack(data))
                while True:
                    try:
                        kind, payload = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    self._message(kind, payload)
                self._submit_ready(core)
                while sched.poll(0):
                    sched.recv()  # Welcome / Reject: nothing to act on
                now = time.monotonic()
                if now - last_report >= self.report_s:
                    last_report = now
                    st = core.status()
                    with self._lock:
                        self.applied, self.version = st.queue_position, st.version
                    sched.send(sc.encode(self.ready_groups()))
        except BaseException as exc:
            log.exception("trajectory service failed")
            self.error = exc
        finally:
            core.close()
            sched.close(0)
            self._pull.close(0)
            self._ctx.term()

    def _record(self, rec: Any) -> None:
        if not isinstance(rec, Call):
            return
        self.records += 1
        self.forest.add(rec)
        self.calls_seen[rec.execution_id] = self.calls_seen.get(rec.execution_id, 0) + 1
        self.output_tokens[rec.execution_id] = self.output_tokens.get(rec.execution_id, 0) + len(
            rec.output_ids
        )

    def _message(self, kind: str, payload: Any) -> None:
        if kind == "batch":
            step, groups = payload
            self.steps[step] = StepData(step, groups)
            return
        step, score, calls = payload
        sd = self.steps[step]
        sd.scores[score.execution_id] = score
        sd.calls_expected[score.execution_id] = calls
        if len(sd.scores) == sum(len(v) for v in sd.groups.values()):
            sd.scored_at = time.monotonic()

    def _complete(self, sd: StepData) -> bool:
        if not sd.scored_at:
            return False
        arrived = all(self.calls_seen.get(e, 0) >= n for e, n in sd.calls_expected.items())
        if not arrived and time.monotonic() - sd.scored_at > self.record_wait_s:
            missing = {e: (self.calls_seen.get(e, 0), n) for e, n in sd.calls_expected.items()}
            raise RuntimeError(f"step {sd.step}: records missing after {self.record_wait_s}s: {missing}")
        return arrived

    def _groups_done(self, sd: StepData) -> int:
        return sum(all(e in sd.scores for e in members) for members in sd.groups.values())

    def ready_groups(self) -> ReadyGroups:
        """Groups ready and not yet applied, for the scheduler."""
        with self._lock:
            applied = self.applied
        ready = 0
        k = applied
        # The core trains steps in order: a later step's complete batch is not trainable while an earlier
        # one is still running (counting it sent a Colocate pool to train with nothing to train).
        while k in self.steps:
            sd = self.steps[k]
            done = self._groups_done(sd)
            if done < len(sd.groups):
                ready += done if self.streaming else 0
                break
            ready += done
            k += 1
        open_ = self.next_submit > applied
        return ReadyGroups(
            ready=ready,
            batch_groups=self.batch_groups,
            version=self.version,
            step_open=open_,
            mean_staleness=float(self._last_staleness()),
        )

    def _last_staleness(self) -> float:
        done = [sd for k, sd in self.steps.items() if sd.submitted and k < self.applied]
        if not done:
            return 0.0
        return float(done[-1].summary.get("staleness_mean", 0.0))

    def _submit_ready(self, core: CoreClient) -> None:
        sd = self.steps.get(self.next_submit)
        hold = self.hold_at
        if sd is None or sd.submitted or (hold is not None and sd.step >= hold) or not self._complete(sd):
            return
        mbs, summary = self.build_minibatch(sd)
        try:
            core.submit(sd.step, mbs)  # an empty one too: the core skips it (no update) and reports so
        except InboxFull:
            return  # the next round tries again
        sd.submitted = True
        sd.summary = summary
        self.next_submit += 1
        log.info("submitted step %d: %s", sd.step, summary)

    def build_minibatch(self, sd: StepData) -> tuple[list[Any], dict[str, Any]]:
        """Select, weight and tree-pack one step's executions (each once)."""
        scores = list(sd.scores.values())
        adv, stats = group_advantages(scores)
        items: list[PackItem] = []
        for eid, a in sorted(adv.items()):
            tree = self.forest.trees.get(eid)
            if tree is None:
                continue
            items.append(PackItem(tree, select(tree, self.sel_cfg), a))
        mbs = pack(items, self.pack_cfg) if items else []
        versions = np.concatenate([b.versions for b in mbs]) if mbs else np.zeros(0, np.int32)
        lag = sd.step - versions.astype(np.int64)
        valid = [s for s in scores if s.status is EvalStatus.OK]
        summary = {
            "step": sd.step,
            "executions": len(scores),
            "trained_executions": [it.tree.execution_id for it in items],
            "eval_failed": stats.eval_failed,
            "timed_out": sum(s.timed_out for s in valid),
            "mean_score": float(np.mean([s.value for s in valid])) if valid else None,
            "microbatches": len(mbs),
            "tokens": int(sum(b.num_tokens for b in mbs)),
            "loss_tokens": int(sum(b.num_loss_tokens for b in mbs)),
            "output_tokens_recorded": int(
                sum(self.output_tokens.get(it.tree.execution_id, 0) for it in items)
            ),
            "staleness_mean": float(lag.mean()) if lag.size else 0.0,
            "staleness_max": int(lag.max()) if lag.size else 0,
        }
        return mbs, summary
