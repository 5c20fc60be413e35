"""Discrete-event simulator of a whole RL run, driven by the same policy objects as the service.

Executions advance on one shared progress clock: a rollout pool of capacity C serving n executions runs
their model calls at min(1, C/n) speed (tool time is unaffected), so each execution's wall time follows
from its nominal duration, the pool size over time and the hard timeout. An execution cut by the timeout
may keep its slot a while past it (`overrun`: a harness that waits for the model call in flight when the
timeout strikes); it still counts as timed out. Training is a fluid queue of ready groups, drained at k
cells over the cell-seconds a group takes with k cells training (`CellConfig.group_s`); with each
execution's training `work` given, a group weighs what its executions brought (an execution cut by the
timeout, the share of its work its progress reached), so that longer executions make longer steps;
switches take the configured times; every role change goes through `CellTable.transition`.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from gyre_sched.cells import CellTable, TableConfig
from gyre_sched.policy import (
    POLICY_NAMES,
    AsyncPolicy,
    ColocatePolicy,
    Observation,
    Policy,
    PredictivePolicy,
    RunAheadColocatePolicy,
    WaterLevelPolicy,
    batches_to_start,
)
from gyre_sched.predict import DurationModel
from gyre_sched.protocol import Action, Decision, Role
from gyre_sched.workload import Workload, sample_durations

EPS = 1e-9
POLICIES = tuple(POLICY_NAMES)


@dataclass(frozen=True, slots=True)
class Segment:
    cell_id: int
    start_s: float
    end_s: float
    role: Role
    busy: float  # share of the cell doing useful work over the segment


@dataclass(frozen=True, slots=True)
class SimResult:
    policy: str
    streaming: bool
    end_to_end_h: float
    idle_rollout: float  # idle share of cell-time spent in rollout
    idle_training: float  # idle share of cell-time spent training
    switching_share: float  # share of all cell-time spent draining or switching
    idle_total: float  # (idle + switching) share of all cell-time
    staleness_mean: float
    staleness_max: float
    switches: int
    timeouts: int
    extra_timeouts: int  # executions that would have finished in time at full service, but timed out
    timeout_service: float  # mean service rate (1 = full speed) received by executions that timed out
    over_4h: float  # share of queries whose longest execution ran over 4 h (wall)
    at_timeout: float  # share of those that ended at the timeout
    decisions: tuple[Decision, ...] = field(repr=False, default=())
    timeline: tuple[Segment, ...] = field(repr=False, default=())

    def summary(self) -> dict[str, float | int | str | bool]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("decisions", "timeline")}


def make_policy(name: str, w: Workload) -> Policy:
    if name == "elastic":
        return WaterLevelPolicy(config=w.elastic)
    if name == "predictive":
        return PredictivePolicy(
            config=w.elastic, model=DurationModel(w.timeout_s, w.predict), predict=w.predict
        )
    if name == "colocate":
        return ColocatePolicy()
    if name == "colocate-runahead":
        return RunAheadColocatePolicy()
    if name == "async":
        return AsyncPolicy(train_cells=w.async_.train_cells)
    raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")


class Simulator:
    """One run of one policy over one sample of durations (shape steps x queries x group_size); `overrun`
    (the same shape, seconds; default none): how long each execution keeps running past its timeout;
    `work` (the same shape, >= 0; default none): each execution's training work were it to run to its
    end, in groups of `CellConfig.group_s` (a group trains in its executions' work, summed, times that;
    an execution that ended short of its duration brings the share of its work its progress reached).
    Without it every group is one, whatever its executions ran."""

    def __init__(
        self,
        w: Workload,
        policy: Policy,
        durations: np.ndarray,
        *,
        streaming: bool | None = None,
        overrun: np.ndarray | None = None,
        work: np.ndarray | None = None,
    ) -> None:
        self.w = w
        self.policy = policy
        self.streaming = w.driver.streaming if streaming is None else streaming
        self.dur = durations
        self.steps, self.Q, self.G = durations.shape
        if overrun is not None and (overrun.shape != durations.shape or bool((overrun < 0).any())):
            raise ValueError(
                f"overrun: shape {durations.shape} of seconds >= 0 expected, got {overrun.shape}"
            )
        self.overrun = np.zeros(durations.shape) if overrun is None else overrun
        if work is not None and (work.shape != durations.shape or not bool(np.isfinite(work).all())
                                 or bool((work < 0).any())):  # fmt: skip
            raise ValueError(
                f"work: shape {durations.shape} of finite values >= 0 expected, got {work.shape}"
            )
        self.work = work
        n = w.run.cells
        self.table = CellTable(TableConfig(max_concurrent_switches=n if policy.moves_together else 1))
        cap = w.cell.rollout_capacity
        for i in range(n):
            self.table.add(i, is_core=(i == 0), capacity=cap)
        self.model = policy.model if isinstance(policy, PredictivePolicy) else None
        self.t = 0.0
        self.V = 0.0  # shared progress clock (seconds of full-speed service)
        self.W = 0.0  # integral of the engines' policy version against V
        self.rate = 1.0
        self.U = 0.0  # the timeout clock: wall time, less pauses unless timeout_counts_pauses
        self.version = 0
        self.launched = 0
        self.finish_heap: list[tuple[float, int]] = []
        self.timeout_heap: list[tuple[float, int]] = []
        m = self.steps * self.Q * self.G
        self.start_t = np.zeros(m)
        self.start_v = np.zeros(m)
        self.start_w = np.zeros(m)
        self.deadline = np.full(m, np.inf)  # on the timeout clock
        self.mean_ver = np.zeros(m)
        self.done = np.zeros(m, dtype=bool)
        self.wall = np.zeros(m)
        self.progress = np.zeros(m)
        self.timed_out = np.zeros(m, dtype=bool)
        self.group_left = np.full((self.steps, self.Q), self.G, dtype=np.int64)
        self.ready = [0] * self.steps
        self.group_work = np.zeros((self.steps, self.Q))
        # the work of each batch's ready groups (one a group without `work`)
        self.ready_work = [0.0] * self.steps
        self.active_by_batch: dict[int, int] = {}
        self.batch_start: dict[int, float] = {}
        self.unfinished = 0
        self.consumed = 0.0
        self.update_end: float | None = None
        self.switch_done: list[tuple[float, int, Role]] = []
        self.stale_sum = 0.0
        self.stale_n = 0
        self.stale_max = 0.0
        self.decisions: list[Decision] = []
        self.cell_time = dict.fromkeys(
            ("rollout", "rollout_idle", "training", "training_idle", "switching"), 0.0
        )
        self.segments: list[Segment] = []
        self._open: dict[int, tuple[float, Role, float, float]] = {}  # cell -> (start, role, busy-time, 0)

    # ---- helpers -----------------------------------------------------------------------------------
    def _available(self) -> float:
        k = self.version
        if k >= self.steps:
            return 0.0
        return self.ready_work[k] if (self.streaming or self.ready[k] == self.Q) else 0.0

    def _train_rate(self) -> float:
        core = self.table.core
        if core is None or core.role is not Role.TRAINING:
            return 0.0
        k = self.table.counts[Role.TRAINING]
        return k / self.w.cell.group_s(k)

    def _training_busy(self) -> bool:
        return self.update_end is not None or (
            self.consumed < self._available() - EPS and self._train_rate() > 0
        )

    def _set_rate(self) -> None:
        cap = self.table.rollout_capacity
        n = self.unfinished
        if n == 0:
            self.rate = 1.0
        elif cap == 0:
            self.rate = 0.0
        else:
            s = max(1.0, n / cap)
            f = self.w.durations.model_fraction
            self.rate = 1.0 / ((1.0 - f) + f * s)

    def observation(self) -> Observation:
        avail = self._available()
        trainable = 0  # ready groups not yet trained: the work left of them, in their count
        if self.update_end is None and avail > EPS:
            groups = self.ready[self.version]
            trainable = max(0, math.ceil(groups * (avail - self.consumed) / avail - 1e-6))
        k = self.version
        ages = tuple(self.t - self.batch_start[b] for b in self.active_by_batch)
        counts = tuple(self.active_by_batch.values())
        return Observation(
            now=self.t,
            unfinished=self.unfinished,
            trainable=trainable,
            batch_groups=self.Q,
            batch_complete=k < self.steps and self.ready[k] == self.Q,
            step_open=self.consumed > EPS or self.update_end is not None,
            updating=self.update_end is not None,
            version=self.version,
            mean_staleness=self.stale_sum / self.stale_n if self.stale_n else 0.0,
            ages=ages,
            age_counts=counts,
            admission_held=self.launched < self.steps and self._room() == 0,
        )

    # ---- time ----------------------------------------------------------------------------------------
    def _advance(self, t1: float) -> None:
        dt = t1 - self.t
        if dt <= 0:
            return
        dv = self.rate * dt
        if self.table.rollout_capacity > 0 or self.w.run.timeout_counts_pauses:
            self.U += dt
        self.W += self.version * dv
        self.V += dv
        cap = self.table.rollout_capacity
        util = min(1.0, self.unfinished / cap) if cap else 0.0
        tbusy = 1.0 if self._training_busy() else 0.0
        ct = self.cell_time
        for c in self.table.cells.values():
            if c.role is Role.ROLLOUT:
                ct["rollout"] += dt
                ct["rollout_idle"] += dt * (1.0 - util)
                busy = util
            elif c.role is Role.TRAINING:
                ct["training"] += dt
                ct["training_idle"] += dt * (1.0 - tbusy)
                busy = tbusy
            else:
                ct["switching"] += dt
                busy = 0.0
            self._record(c.cell_id, c.role, busy, dt)
        if self.update_end is None and self._train_rate() > 0:
            self.consumed = min(float(self._available()), self.consumed + self._train_rate() * dt)
        self.t = t1

    def _record(self, cid: int, role: Role, busy: float, dt: float) -> None:
        cur = self._open.get(cid)
        if cur is not None and cur[1] is role and abs(cur[3] - busy) < 0.05:
            self._open[cid] = (cur[0], role, cur[2] + busy * dt, cur[3])
            return
        if cur is not None:
            self._close(cid, self.t)
        self._open[cid] = (self.t, role, busy * dt, busy)

    def _close(self, cid: int, t: float) -> None:
        start, role, busy_t, _ = self._open.pop(cid)
        if t > start:
            self.segments.append(Segment(cid, start, t, role, busy_t / (t - start)))

    # ---- events --------------------------------------------------------------------------------------
    def _room(self) -> int:
        """Batches the admission bound lets start now (see `_launch`)."""
        target = self.w.driver.staleness_target
        ahead = self.w.driver.max_ahead
        if self.stale_n and self.stale_sum / self.stale_n > target:
            ahead = min(ahead, int(target))
        return batches_to_start(
            self.policy.admission, started=self.launched, trained=self.version, max_ahead=ahead
        )

    def _launch(self) -> None:
        """Start the batches the policy's admission allows now (`batches_to_start`). The staleness target
        narrows the bound: while the measured mean staleness of the steps trained so far is above the
        target, a batch may run at most floor(target) steps ahead instead of `max_ahead` (never fewer
        than 0: the next untrained batch may always start). Called after every optimizer step, the only
        time the bound, the measured staleness or COHORT's condition can change."""
        for _ in range(min(self._room(), self.steps - self.launched)):
            b = self.launched
            self.launched += 1
            base = b * self.Q * self.G
            self.batch_start[b] = self.t
            self.active_by_batch[b] = self.Q * self.G
            self.unfinished += self.Q * self.G
            deadline = self.U + self.w.timeout_s
            for i in range(self.Q * self.G):
                e = base + i
                q, g = divmod(i, self.G)
                self.start_t[e] = self.t
                self.start_v[e] = self.V
                self.start_w[e] = self.W
                self.deadline[e] = deadline
                heapq.heappush(self.finish_heap, (self.V + float(self.dur[b, q, g]), e))
                heapq.heappush(self.timeout_heap, (deadline + float(self.overrun[b, q, g]), e))

    def _end(self, e: int, timed_out: bool) -> None:
        if self.done[e]:
            return
        self.done[e] = True
        over = self.U - self.deadline[e]
        timed_out = timed_out or over > 1e-6  # its work ended in its overrun: it was cut all the same
        self.timed_out[e] = timed_out
        wall = self.t - self.start_t[e]
        self.wall[e] = wall
        dv = self.V - self.start_v[e]
        self.progress[e] = dv
        self.mean_ver[e] = (self.W - self.start_w[e]) / dv if dv > EPS else float(self.version)
        b, rest = divmod(e, self.Q * self.G)
        q = rest // self.G
        self.unfinished -= 1
        self.active_by_batch[b] -= 1
        if self.active_by_batch[b] == 0:
            del self.active_by_batch[b]
        if self.work is not None:
            dur = float(self.dur.flat[e])
            self.group_work[b, q] += float(self.work.flat[e]) * (min(1.0, dv / dur) if dur > EPS else 1.0)
        self.group_left[b, q] -= 1
        if self.group_left[b, q] == 0:
            self.ready[b] += 1
            self.ready_work[b] += 1.0 if self.work is None else float(self.group_work[b, q])
        if self.model is not None:
            self.model.observe(wall, timed_out)

    def _finish_update(self) -> None:
        k = self.version
        base = k * self.Q * self.G
        lag = k - self.mean_ver[base : base + self.Q * self.G]
        self.stale_sum += float(lag.sum())
        self.stale_n += lag.size
        self.stale_max = max(self.stale_max, float(lag.max()))
        self.version += 1
        self.consumed = 0.0
        self.update_end = None
        self._launch()

    def _apply(self, d: Decision) -> None:
        tab = self.table
        cell = tab.cells[d.cell_id]
        if d.action is Action.TO_TRAINING:
            tab.transition(cell.cell_id, Role.DRAINING, self.t, protects=d.protects)
            tab.transition(cell.cell_id, Role.TO_TRAINING, self.t)
            self.switch_done.append((self.t + self.w.cell.to_training_s, cell.cell_id, Role.TRAINING))
        else:
            tab.transition(cell.cell_id, Role.TO_ROLLOUT, self.t)
            self.switch_done.append((self.t + self.w.cell.to_rollout_s, cell.cell_id, Role.ROLLOUT))
        self.decisions.append(d)

    def _complete_switches(self) -> None:
        pending = sorted(self.switch_done, key=lambda x: (x[0], not self.table.cells[x[1]].is_core, x[1]))
        self.switch_done = []
        for due, cid, role in pending:
            if due > self.t + EPS:
                self.switch_done.append((due, cid, role))
                continue
            core = self.table.core
            sat = not self.table.cells[cid].is_core
            if role is Role.TRAINING and sat and core is not None and core.role is not Role.TRAINING:
                self.switch_done.append((max(due, self.t) + 1.0, cid, role))  # a satellite waits for the core
                continue
            self.table.transition(cid, role, self.t)

    def _decide(self) -> None:
        for d in self.policy.decide(self.observation(), self.table):
            self._apply(d)

    def run(self) -> SimResult:
        self._launch()
        tick = self.w.driver.decision_interval_s
        next_tick = 0.0
        self._decide()
        self._set_rate()
        slowest = max((self.w.cell.train_group_s, *self.w.cell.train_group_s_by_cells))
        heaviest = 1.0 if self.work is None else max(1.0, float(self.work.sum(axis=-1).max()))
        limit = 1000.0 * self.steps * (self.w.timeout_s + slowest * self.Q * heaviest)
        while self.version < self.steps:
            cands = [next_tick]
            fh = self.finish_heap
            while fh and self.done[fh[0][1]]:
                heapq.heappop(fh)
            if fh and self.rate > 0:
                cands.append(self.t + max(0.0, fh[0][0] - self.V) / self.rate)
            th = self.timeout_heap
            while th and self.done[th[0][1]]:
                heapq.heappop(th)
            if th and (self.table.rollout_capacity > 0 or self.w.run.timeout_counts_pauses):
                cands.append(self.t + max(0.0, th[0][0] - self.U))
            if self.update_end is not None:
                cands.append(self.update_end)
            elif self._train_rate() > 0 and self.consumed < self._available() - EPS:
                cands.append(self.t + (self._available() - self.consumed) / self._train_rate())
            cands.extend(s[0] for s in self.switch_done)
            t1 = max(self.t, min(cands))
            if t1 > limit:
                raise RuntimeError(f"simulation made no progress by t={t1:.0f}s (policy {self.policy.name})")
            self._advance(t1)
            while fh and fh[0][0] <= self.V + 1e-6:
                _, e = heapq.heappop(fh)
                self._end(e, False)
            while th and th[0][0] <= self.U + 1e-6:
                _, e = heapq.heappop(th)
                self._end(e, True)
            k = self.version
            if (
                self.update_end is None
                and self.ready[k] == self.Q
                and self.consumed >= self.ready_work[k] - 1e-6
            ):
                self.update_end = self.t + self.w.cell.update_s
            elif self.update_end is not None and self.update_end <= self.t + EPS:
                self._finish_update()
            self._complete_switches()
            if self.t >= next_tick - EPS:
                next_tick = self.t + tick
            self._decide()
            self._set_rate()
        for cid in list(self._open):
            self._close(cid, self.t)
        return self._result()

    def _result(self) -> SimResult:
        ct = self.cell_time
        total = ct["rollout"] + ct["training"] + ct["switching"]
        to = self.timed_out
        nominal = self.dur.ravel()
        wall = self.wall
        longest = wall.reshape(self.steps, self.Q, self.G).max(axis=-1).ravel()
        over = longest > 4 * 3600.0
        at_to = self.timed_out.reshape(self.steps, self.Q, self.G).any(axis=-1).ravel()
        svc = np.where(to, np.minimum(1.0, self.progress / np.maximum(wall, EPS)), 0.0)
        return SimResult(
            policy=self.policy.name,
            streaming=self.streaming,
            end_to_end_h=self.t / 3600.0,
            idle_rollout=ct["rollout_idle"] / ct["rollout"] if ct["rollout"] else 0.0,
            idle_training=ct["training_idle"] / ct["training"] if ct["training"] else 0.0,
            switching_share=ct["switching"] / total if total else 0.0,
            idle_total=(ct["rollout_idle"] + ct["training_idle"] + ct["switching"]) / total if total else 0.0,
            staleness_mean=self.stale_sum / self.stale_n if self.stale_n else 0.0,
            staleness_max=self.stale_max,
            switches=len(self.decisions),
            timeouts=int(to.sum()),
            extra_timeouts=int((to & (nominal < self.w.timeout_s)).sum()),
            timeout_service=float(svc[to].mean()) if to.any() else 1.0,
            over_4h=float(over.mean()),
            at_timeout=float((at_to & over).sum()) / max(1, int(over.sum())),
            decisions=tuple(self.decisions),
            timeline=tuple(self.segments),
        )


def run_one(
    w: Workload,
    policy: str,
    *,
    streaming: bool | None = None,
    durations: np.ndarray | None = None,
    overrun: np.ndarray | None = None,
    work: np.ndarray | None = None,
) -> SimResult:
    """Simulate `policy` on the workload's seeded sample (or on `durations`), with each execution's
    seconds past its timeout (`overrun`, default none: cut at it) and training work (`work`, default
    none: one a group; see `Simulator`)."""
    d = sample_durations(w) if durations is None else durations
    return Simulator(w, make_policy(policy, w), d, streaming=streaming, overrun=overrun, work=work).run()


def compare(
    w: Workload, *, streaming: list[bool] | None = None, predictive: bool = True
) -> tuple[list[SimResult], dict[str, float]]:
    """Run elastic, colocate, async, colocate-runahead (and the predictive variant) on one sample; return
    the results and the speed-ups of elastic over each (and of predictive over elastic) per streaming
    mode. Streaming changes nothing for the Colocate variants, which train whole batches only."""
    d = sample_durations(w)
    results: list[SimResult] = []
    summary: dict[str, float] = {}
    for s in streaming or [w.driver.streaming]:
        names = ["elastic", "colocate", "async", "colocate-runahead"]
        names += ["predictive"] if predictive else []
        rs = {n: run_one(w, n, streaming=s, durations=d) for n in names}
        results.extend(rs.values())
        tag = "" if s else "_no_streaming"
        e = rs["elastic"].end_to_end_h
        summary[f"speedup_vs_async{tag}"] = rs["async"].end_to_end_h / e
        summary[f"speedup_vs_colocate{tag}"] = rs["colocate"].end_to_end_h / e
        summary[f"speedup_vs_colocate_runahead{tag}"] = rs["colocate-runahead"].end_to_end_h / e
        if predictive:
            summary[f"predictive_gain{tag}"] = e / rs["predictive"].end_to_end_h
    return results, summary
