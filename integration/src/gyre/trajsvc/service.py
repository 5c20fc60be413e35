"""The trajectory service: records in from gyre-proxy, training data out to gyre-train's core.

It PULLs the proxy's TITO records (ZeroMQ, msgpack) into a gyre-traj `Forest` and takes each
execution's `Score` from the driver; the bookkeeping is `stepbook.StepBook`'s. Streaming (the default),
step k is opened on the core (`CoreClient.open_step`, in queue order) as soon as its batch starts, and
each group is given to it (`add`) as soon as the group is scored and every call the harness completed has
arrived as a record: packed on its own, with loss weights re-made into per-execution token means
(`gyre_train.normalize.execution_means`); once every group is given the step is closed with its
micro-batch count and its executions with loss tokens (`close_step`), by which the core divides the
summed gradient. Whole steps (`streaming=False`): once every group of step k is ready, the step is packed
at once and submitted (`submit`). Either way each execution goes into exactly one step, and a step with
nothing trainable is handed over empty (the core skips it). Every `report_s` it reads the core's status
and tells gyre-sched the ready groups not yet trained (`StepBook.report`). Each step handed over goes to
`on_closed` (the run's `ledger.Ledger`) with what it trained. A resumed run starts at `first_step` (the
checkpoint's queue position); `replay` adds records read back from the proxy's log, each call once.

Every link carries the run token (`token`, else `$GYRE_TOKEN`; gyre-xfer `auth`): the PULL binds through
`gyre_base.sockets.bind` (beyond loopback only with a token; with one, only pushers holding it are heard), the
scheduler DEALER is `gyre_sched.client.dealer`, and the core is reached through a `CoreClient` with it.
The PULL survives any message from a peer holding the token: one that is not a single frame holding a
call record the forest accepts is logged, counted (`dropped`) and dropped, and the service carries on.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
import zmq
from gyre_base import sockets
from gyre_sched.client import dealer
from gyre_sched.protocol import Codec as SchedCodec
from gyre_sched.protocol import Hello, PeerKind, ReadyGroups
from gyre_train.control import CoreClient, InboxFull
from gyre_train.normalize import execution_means
from gyre_train.protocol import StepInfo
from gyre_traj.records import Call, RecordError, Score
from gyre_traj.weights import group_advantages

from gyre.trajsvc.stepbook import Packed, StepBook, StepData

log = logging.getLogger("gyre.trajsvc")
LOGGED_DROPS = 10
"""Dropped messages logged one by one; after these, one line per 1,000 (a peer that floods the PULL
with junk cannot flood the log)."""


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
        first_step: int = 0,
        on_closed: Callable[[dict[str, Any]], None] | None = None,
        bind: str = "tcp://127.0.0.1:0",
        token: str = "",
    ) -> None:
        """`bind`: where the records PULL listens (beyond loopback it needs a token); `token`: the run
        token of every link ("" reads $GYRE_TOKEN; none: loopback only)."""
        self.streaming = streaming
        self.book = StepBook(
            batch_groups,
            streaming=streaming,
            token_budget=token_budget,
            j_max=j_max,
            record_wait_s=record_wait_s,
        )
        self.report_s = report_s
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.RCVHWM, 100_000)
        self._token = token
        try:
            self.address = sockets.bind(self._pull, bind, token, "TrajectoryService token, GYRE_TOKEN")
        except BaseException:
            self._pull.close(0)
            self._ctx.term()
            raise
        self._sched_address = sched_address
        self._core_address = core_address
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._lock = threading.Lock()
        self._next_open = first_step
        """Streaming: the next step to open on the core (steps are opened in queue order)."""
        self.steps_closed = first_step
        """Steps handed to the core whole (closed, or submitted), counted from step 0."""
        self._on_closed = on_closed
        self._packed_calls: dict[str, int] = {}
        """Execution id -> the calls it had when it was packed (the ledger's `calls_packed`)."""
        self._replayed: queue.Queue[Call] = queue.Queue()
        self.applied = first_step
        """Steps the core has applied (its queue position)."""
        self.version = 0
        self.records = 0
        self.dropped = 0
        """Messages on the records PULL that were not a call record the forest accepts (dropped, logged)."""
        self.error: BaseException | None = None
        self.hold_at: int | None = None
        """Steps from this one on are not closed or submitted (an evaluation needs the version to stay
        put); streamed groups of a held step still go to the core, which computes but cannot apply them,
        and count no ready groups for the scheduler (the evaluation needs a rollout engine)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trajectory-service", daemon=True)

    @property
    def steps(self) -> dict[int, StepData]:
        return self.book.steps

    # ---- what the driver calls (any thread) ---------------------------------------------------------
    def register_batch(self, step: int, groups: dict[str, list[str]]) -> None:
        self._inbox.put(("batch", (step, groups)))

    def score(self, step: int, score: Score, calls: int) -> None:
        self._inbox.put(("score", (step, score, calls)))

    def replay(self, calls: Iterable[Call]) -> None:
        """Records read back from the proxy's log (after a proxy restart: some may never have been
        pushed); calls already received are skipped, by call id."""
        for c in calls:
            self._replayed.put(c)

    def recorded_calls(self, execution_id: str) -> int:
        """Records received so far for one execution (any thread: dict lookups)."""
        return self.book.calls_of(execution_id)

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
        sc = SchedCodec()
        sched = dealer(self._ctx, self._sched_address, self._token)
        sched.send(sc.encode(Hello(PeerKind.TRAJ)))
        core = CoreClient(self._core_address, timeout_s=30.0, token=self._token)
        last_report = 0.0
        try:
            while not self._stop.is_set():
                self._receive()
                now = time.monotonic()
                for sd in self.book.steps.values():
                    if not sd.closed:
                        self.book.update_ready(sd, now)
                if self.streaming:
                    self._stream(core)
                else:
                    self._submit_whole(core)
                while sched.poll(0):
                    sched.recv()  # Welcome / Reject: nothing to act on
                if now - last_report >= self.report_s:
                    last_report = now
                    sched.send(sc.encode(self._report(core)))
        except BaseException as exc:
            if self._stop.is_set():  # the run is ending (its core may be gone first): not a failure
                log.info("trajectory service stopped: %s", exc)
                return
            log.exception("trajectory service failed")
            self.error = exc
        finally:
            core.close()
            sched.close(0)
            self._pull.close(0)
            self._ctx.term()

    def _receive(self) -> None:
        """Records from the proxy (up to 1,000 a round), then the driver's batches and scores."""
        if self._pull.poll(20):
            for _ in range(1000):
                try:
                    msg = self._pull.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._take(msg)
        while True:
            try:
                self._record(self._replayed.get_nowait())
            except queue.Empty:
                break
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "batch":
                self.book.register(*payload)
            else:
                step, score, calls = payload
                self.book.score(step, score, calls, now=time.monotonic())

    def _take(self, msg: list[bytes]) -> None:
        """One message from the PULL: a call record in one frame goes to the book; anything else (more
        frames, bytes that do not decode, another kind of record, a call its execution's tree refuses, or
        any other failure of this one message) is dropped, logged and counted."""
        try:
            if len(msg) != 1:
                raise RecordError(f"a message of {len(msg)} frames (a record is one frame)")
            # the forest's live path takes a call record from its bytes; a call booked already is
            # skipped (the proxy may send one again), anything else that is not one is refused
            if self.book.record_frame(msg[0]):
                self.records += 1
        except (msgspec.DecodeError, msgspec.ValidationError, RecordError) as exc:
            self._drop(exc)
        except Exception as exc:  # a defect in decoding or ingesting one message must not end the service
            self._drop(exc, unexpected=True)

    def _drop(self, exc: Exception, unexpected: bool = False) -> None:
        self.dropped += 1
        n = self.dropped
        if n <= LOGGED_DROPS or n % 1000 == 0:
            log.log(
                logging.ERROR if unexpected else logging.WARNING,
                "records PULL: dropped a message (%d so far%s): %s: %s",
                n,
                "; from here on one line per 1,000" if n == LOGGED_DROPS else "",
                type(exc).__name__,
                exc,
                exc_info=unexpected,
            )

    def _record(self, rec: Call) -> None:
        """Book a call once (by call id, in its execution); RecordError if its execution's tree refuses
        it (then it is not booked: the same call may still come whole)."""
        if self.book.record(rec):
            self.records += 1

    def _report(self, core: CoreClient) -> ReadyGroups:
        st = core.status()
        with self._lock:
            self.applied, self.version = st.queue_position, st.version
        infos: dict[int, StepInfo] = {i.seq: i for i in st.steps}
        return self.book.report(st.queue_position, st.version, infos, self.hold_at)

    def _stream(self, core: CoreClient) -> None:
        """Open steps in order as their batches start; give each ready group; close complete steps."""
        while self._next_open in self.book.steps:
            try:
                core.open_step(self._next_open)
            except InboxFull:
                break  # the next round tries again
            self.book.steps[self._next_open].opened = True
            self._next_open += 1
        for sd in self.book.steps.values():
            if not sd.opened or sd.closed:
                continue
            for g in [g for g in sd.ready if g not in sd.given]:
                p = self.book.pack(sd, [g])
                self._note_packed(sd.step, p)
                mbs, executions = execution_means(p.microbatches) if p.microbatches else ([], 0)
                if mbs:
                    core.add(sd.step, mbs)
                    sd.first_given_at = sd.first_given_at or time.time()
                sd.given[g] = len(mbs)
                sd.tally.add(p, mbs, executions)
            if sd.complete and not self._held(sd.step):
                self._ledger(sd, list(sd.tally.trained), sd.tally.over_budget)
                core.close_step(sd.step, sd.tally.microbatches, max(1, sd.tally.executions))
                self._closed(sd)

    def _submit_whole(self, core: CoreClient) -> None:
        sd = self.book.steps.get(self.steps_closed)
        if sd is None or sd.closed or not sd.complete or self._held(sd.step):
            return
        p = self.book.pack(sd, sd.groups)
        self._note_packed(sd.step, p)
        self._ledger(sd, [it.tree.execution_id for it in p.items], p.over_budget)
        # an empty one too: the core skips it (no update)
        try:
            core.submit(sd.step, p.microbatches)
        except InboxFull:
            return  # the next round tries again
        sd.tally.add(p, p.microbatches, len(p.items))
        sd.first_given_at = time.time()
        self._closed(sd)

    def _note_packed(self, step: int, p: Packed) -> None:
        for it in p.items:
            e = it.tree.execution_id
            self._packed_calls[e] = self.book.calls_of(e)
        for e, n in p.over_budget.items():
            log.warning(
                "step %d: execution %s set aside, untrained: its longest path has %d tokens, over the "
                "micro-batch budget of %d ([train] token_budget; with [train] chunk_budget a larger budget "
                "trains in chunks of that many tokens)",
                step, e, n, self.book.pack_cfg.token_budget,
            )  # fmt: skip

    def _ledger(self, sd: StepData, trained: list[str], over_budget: Iterable[str] = ()) -> None:
        """Tell `on_closed` what step `sd` trains, before the core is given the step whole (a crash in
        between leaves a line for a step not applied, which a resume drops); executions without an
        advantage and those set aside with a path over the budget are not trainable (not lost)."""
        if self._on_closed is None:
            return
        adv, _ = group_advantages(sd.scores.values())
        self._on_closed(
            {
                "step": sd.step,
                "batch_executions": [e for g in sd.groups.values() for e in g],
                "not_trainable": sorted({e for e in sd.scores if e not in adv} | set(over_budget)),
                "trained_executions": trained,
                "calls_packed": {e: self._packed_calls.get(e, 0) for e in trained},
                "calls_answered": dict(sd.calls_expected),
            }
        )

    def _held(self, step: int) -> bool:
        hold = self.hold_at
        return hold is not None and step >= hold

    def _closed(self, sd: StepData) -> None:
        sd.closed = True
        sd.closed_at = time.time()
        sd.summary = {
            **sd.tally.summary(sd.step, sd.scores.values()),
            "first_given_at": sd.first_given_at,
            "closed_at": sd.closed_at,
        }
        self.steps_closed += 1
        log.info("handed over step %d: %s", sd.step, sd.summary)
