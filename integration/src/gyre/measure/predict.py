"""The gyre-sched simulator's view of a `gyre run` configuration.

`sim_workload` turns a run config into gyre-sched's `Workload` (cells, steps, batch, the duration profile
in hours, the execution timeout, the water-level and Async settings). The same workload's
`sample_durations` drives the real run's executions, so measurement and prediction share one sample.
What the config cannot know (seconds of training per group, optimizer step and weight push, switch
times, the model-time share, how long an execution cut by the timeout keeps its slot) comes from
`Calibration`: defaults before a measurement, or figures measured in a run (`calibrate`), which is what
`gyre compare` feeds the simulator.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from gyre_sched.policy import WaterLevelConfig
from gyre_sched.sim import run_one
from gyre_sched.workload import (
    AsyncConfig,
    BatchConfig,
    CellConfig,
    DriverConfig,
    DurationConfig,
    RunConfig,
    Workload,
    sample_durations,
)

from gyre.config.runconfig import Config

OVERRUN_QUANTILES = 21
"""Points of the measured distribution of seconds past the timeout kept in a calibration (0%, 5%, ... 100%)."""
AT_TIMEOUT_S = 0.05
"""An execution cut by the timeout that ended within this of it had no model call in flight (it was cut in
its tool time)."""

Slept = Callable[[tuple[int, int, int], int, float], float]
"""(where, calls made, the outcome's planned tool seconds) -> tool seconds slept before those calls."""


@dataclass(frozen=True)
class Calibration:
    train_group_s: float = 2.0
    """Cell-seconds to train one group: the training cells' busy time on a step (sampled: micro-batches
    queued, being computed or applied), over its groups."""
    train_group_s_by_cells: tuple[float, ...] = ()
    """The same by how many cells trained the step (item k-1 for k cells; a count between two measured is
    interpolated, one below the fewest measured takes the fewest's): two cells on one GPU train a group
    in more cell-seconds side by side than one beside a serving cell. Empty: `train_group_s` at any
    count."""
    train_group_calls: float | None = None
    """Model calls a group's executions made, in the steps the training seconds were measured on (the
    median): `train_group_s` and `train_group_s_by_cells` are the seconds of a group of that many calls,
    and `predict` trains each simulated group in its executions' calls over this (the trained tokens
    follow the calls made: on the agent-shaped H200 runs 1,420-1,670 trained tokens a call, step by step,
    while the steps' calls ranged 1.7x). None where the runs do not say which calls each step trained:
    every group is then one, whatever its executions ran."""
    update_s: float = 0.5
    """Optimizer step plus the weight push to the engines."""
    to_training_s: float = 0.5
    to_rollout_s: float = 0.5
    model_call_s: float | None = None
    """Seconds per model call at full speed, measured: an execution's wall time less its tool time, per
    call, times the speed the simulator's congestion model gives it over its life in the run (the mean of
    min(1, C/n): C the rollout capacity, n the executions running; `run_speed`), so that the queueing the
    run had is not counted again when the simulator slows calls down by its own n/C. With it the
    simulator's executions are the harness's tool time plus `turns` such calls (or each execution's planned
    calls, when the harness plans them: the profile harness), instead of the nominal profile's model share
    (which the tiny model on a CPU does not fill)."""
    run_speed: float = 1.0
    """The median of that speed over the executions measured: 1 where they ran uncongested; the seconds
    per call the runs measured are `model_call_s` / this."""
    timeout_overrun_s: tuple[float, ...] = ()
    """Quantiles (`OVERRUN_QUANTILES`, evenly spaced from 0 to 1) of the seconds past the timeout at which
    executions cut by it ended, measured: a harness waits for the call in flight when the timeout strikes,
    and the execution holds its slot meanwhile. Empty: cut at the timeout."""


def sim_workload(cfg: Config, cal: Calibration | None = None, calls: np.ndarray | None = None) -> Workload:
    """The simulator's workload for `cfg`; with a calibration's seconds per call, the model share of the
    durations is the calls' share of `sim_durations` (`calls`: each execution's planned calls)."""
    cal = cal or Calibration()
    a = cfg.agent
    return Workload(
        name=f"gyre-run-{cfg.run.policy}",
        run=RunConfig(
            steps=cfg.run.steps,
            cells=cfg.run.cells,
            seed=cfg.run.seed,
            timeout_h=a.timeout_s / 3600.0,
            timeout_counts_pauses=True,  # the harness's clock keeps running while no engine serves it
        ),
        batch=BatchConfig(queries=cfg.batch.queries, group_size=cfg.batch.group_size),
        durations=DurationConfig(
            kind="lognormal",
            median_h=a.median_s / 3600.0,
            sigma=a.sigma,
            exec_sigma=a.exec_sigma,
            model_fraction=a.model_fraction
            if cal.model_call_s is None
            else _model_share(cfg, cal.model_call_s, calls),
        ),
        cell=CellConfig(
            rollout_capacity=cfg.cell.capacity,
            train_group_s=max(cal.train_group_s, 1e-3),
            train_group_s_by_cells=tuple(max(g, 1e-3) for g in cal.train_group_s_by_cells),
            update_s=cal.update_s,
            to_training_s=cal.to_training_s,
            to_rollout_s=cal.to_rollout_s,
        ),
        driver=DriverConfig(
            max_ahead=cfg.driver.max_ahead,
            staleness_target=1e9,  # the real driver bounds staleness by max_ahead only
            streaming=cfg.streams,
            decision_interval_s=0.2,
        ),
        elastic=WaterLevelConfig(
            ready_fraction=cfg.sched.ready_fraction,
            hold_s=cfg.sched.hold_s,
            train_complete_steps=cfg.sched.train_complete_steps,
        ),
        async_=AsyncConfig(train_cells=cfg.sched.async_train_cells),
    )


def _model_share(cfg: Config, call_s: float, calls: np.ndarray | None) -> float:
    """The model calls' share of the run's `sim_durations`, over all its executions."""
    d = durations(cfg)
    model = float((calls if calls is not None else np.full(d.shape, cfg.agent.turns)).sum()) * call_s
    tool = float(d.sum()) * (1.0 - cfg.agent.model_fraction)
    return float(min(1.0, max(1e-3, model / (model + tool))))


def sim_durations(cfg: Config, cal: Calibration, calls: np.ndarray | None = None) -> np.ndarray:
    """Full-service durations the simulator is given: the run's nominal sample, or, calibrated, the
    harness's tool time plus its calls at the measured seconds per call (`calls`: each execution's planned
    calls, shape (steps, queries, group_size); else `turns` each)."""
    d = durations(cfg)
    if cal.model_call_s is None:
        return d
    n = calls if calls is not None else cfg.agent.turns
    out: np.ndarray = d * (1.0 - cfg.agent.model_fraction) + n * cal.model_call_s
    return out


def durations(cfg: Config) -> np.ndarray:
    """Nominal seconds per execution, shape (steps, queries, group_size): the real run's and the sim's."""
    return sample_durations(sim_workload(cfg))


def calibrate(
    metrics: list[dict[str, Any]], calls: np.ndarray | None = None, slept: Slept | None = None
) -> Calibration:
    """Machine-dependent times measured in runs (medians over every run given); with `calls` (each
    execution's planned calls), seconds per call are per planned call of each execution (per call made,
    for an execution that ended at its timeout). An outcome's `tool_s` is its whole plan's tool time: with
    `slept` (the harness's plan) an execution cut by the timeout counts only the tool time slept before
    the calls it made, and one cut in its tool time (ended at the timeout, no call in flight) is left out
    (its share of the sleep in hand is unknown); without it, the whole `tool_s`."""
    group_s: list[float] = []
    by_cells: dict[int, list[float]] = {}
    call_cost: list[float] = []  # busy training cell-seconds per model call made, step by step
    call_cost_by_cells: dict[int, list[float]] = {}
    group_calls: list[float] = []
    update_s: list[float] = []
    to_t: list[float] = []
    to_r: list[float] = []
    call_s: list[float] = []
    speeds: list[float] = []
    overrun: list[float] = []
    for m in metrics:
        timeout = (m.get("config") or {}).get("agent", {}).get("timeout_s")
        speed = run_speed(m)
        calls_of_batch: dict[int, int] = {}  # the calls each batch's executions made (its step trains them)
        for o in m.get("outcomes", []):
            if "where" in o:
                k = int(o["where"][0])
                calls_of_batch[k] = calls_of_batch.get(k, 0) + int(o["calls"])
            if o["error"] or o["calls"] <= 0:
                continue
            wall, tool = o["end"] - o["start"], o.get("tool_s", 0.0)
            if o["timed_out"] and timeout is not None:
                overrun.append(max(0.0, wall - timeout))
            # an execution that ended at the timeout made `calls` of its planned calls by then
            if o["timed_out"] or calls is None or "where" not in o:
                n = o["calls"]
                if o["timed_out"] and slept is not None and "where" in o:
                    if timeout is not None and wall - timeout < AT_TIMEOUT_S:
                        continue
                    tool = slept(tuple(o["where"]), n, tool)
            else:
                n = int(calls[tuple(o["where"])])
            v = speed(o["start"], o["end"])
            speeds.append(v)
            call_s.append(max(0.0, wall - tool) / n * v)
        for s in m["steps"]:
            if s.get("skipped") or not s.get("groups"):
                continue
            if "busy_cell_s" in s:  # sampled busy training (a streamed step's elapsed_s includes waits)
                if s["busy_cell_s"] > 0:
                    group_s.append(s["busy_cell_s"] / s["groups"])
                    if s.get("training_cells"):
                        by_cells.setdefault(s["training_cells"], []).append(group_s[-1])
                    made = calls_of_batch.get(int(s.get("step", -1)), 0)
                    if made > 0:
                        call_cost.append(s["busy_cell_s"] / made)
                        group_calls.append(made / s["groups"])
                        if s.get("training_cells"):
                            call_cost_by_cells.setdefault(s["training_cells"], []).append(call_cost[-1])
            elif s.get("elapsed_s"):  # metrics written before training was sampled
                group_s.append(s["elapsed_s"] * max(1, s.get("training_cells", 1)) / s["groups"])
            if s.get("push_s") is not None:
                update_s.append(s["push_s"])
        to_t += m["switch_times"]["to_training_s"]
        to_r += m["switch_times"]["to_rollout_s"]
    med = statistics.median
    q = np.linspace(0.0, 1.0, OVERRUN_QUANTILES)
    per_group: float | None = None
    # every step's training seconds with the calls it trained: seconds a call, as seconds of a group of
    # the median calls
    if call_cost and len(call_cost) == len(group_s):
        per_group = med(group_calls)
        group_s = [c * per_group for c in call_cost]
        by_cells = {k: [c * per_group for c in v] for k, v in call_cost_by_cells.items()}
    return Calibration(
        train_group_s=med(group_s) if group_s else Calibration.train_group_s,
        train_group_s_by_cells=_by_cells({k: med(v) for k, v in by_cells.items()}),
        train_group_calls=round(per_group, 4) if per_group is not None else None,
        update_s=med(update_s) if update_s else Calibration.update_s,
        to_training_s=med(to_t) if to_t else Calibration.to_training_s,
        to_rollout_s=med(to_r) if to_r else Calibration.to_rollout_s,
        model_call_s=med(call_s) if call_s else None,
        run_speed=round(med(speeds), 4) if speeds else 1.0,
        timeout_overrun_s=tuple(round(float(x), 3) for x in np.quantile(overrun, q)) if overrun else (),
    )


def run_speed(m: dict[str, Any]) -> Callable[[float, float], float]:
    """For one run's metrics: (start, end) -> the mean over [start, end] of min(1, C/n), the speed the
    simulator gives model calls when n executions run on a rollout capacity of C. n counts the run's
    outcomes running at each instant; C is the cells in rollout (`rollout_cells`: change points in seconds
    from the run's first batch) times `[cell] capacity`. Metrics written before the change points were kept
    count every cell in rollout but Async's training cells; metrics without a config, 1 throughout."""
    cfg = m.get("config") or {}
    if "capacity" not in cfg.get("cell", {}):  # no capacity known: no congestion to take out
        return lambda a, b: 1.0
    cap = float(cfg["cell"]["capacity"])
    t0 = float(m.get("t0", 0.0))
    if m.get("rollout_cells"):
        at = np.array([t0 + t for t, _ in m["rollout_cells"]])
        cells = np.array([float(c) for _, c in m["rollout_cells"]])
    else:
        run = cfg.get("run", {})
        fixed = run.get("cells", 1) - (
            cfg.get("sched", {}).get("async_train_cells", 1) if run.get("policy") == "async" else 0
        )
        at, cells = np.array([-np.inf]), np.array([float(fixed)])
    spans = [(o["start"], o["end"]) for o in m.get("outcomes", []) if o["end"] > o["start"]]
    starts = np.sort(np.array([a for a, _ in spans]))
    ends = np.sort(np.array([b for _, b in spans]))

    def speed(a: float, b: float) -> float:
        if b <= a:
            return 1.0
        inside = (starts > a) & (starts < b)
        cuts = np.unique(
            np.concatenate([[a, b], starts[inside], ends[(ends > a) & (ends < b)], at[(at > a) & (at < b)]])
        )
        mid = (cuts[:-1] + cuts[1:]) / 2
        n = np.searchsorted(starts, mid, side="right") - np.searchsorted(ends, mid, side="right")
        c = cap * cells[np.maximum(np.searchsorted(at, mid, side="right") - 1, 0)]
        v = np.minimum(1.0, c / np.maximum(n, 1))
        return float(np.dot(v, np.diff(cuts)) / (b - a))

    return speed


def _by_cells(measured: dict[int, float]) -> tuple[float, ...]:
    """Item k-1 for k = 1 .. the most cells measured: the measured median, else interpolated between the
    counts measured on either side, else (below the fewest measured) the fewest's."""
    if not measured:
        return ()
    ks = sorted(measured)
    vs = [measured[k] for k in ks]
    return tuple(round(float(np.interp(k, ks, vs)), 4) for k in range(1, ks[-1] + 1))


OVERRUN_DRAWS = 15
"""Draws of the seconds past the timeout the prediction simulates (odd: its figures are the median
draw's)."""


def overruns(cfg: Config, cal: Calibration, draw: int = 0) -> np.ndarray | None:
    """Seconds each execution of the run would keep its slot past the timeout were it cut by it: draw
    `draw` (seeded by the run's seed) from the calibration's measured distribution; None without one."""
    qs = cal.timeout_overrun_s
    if not qs:
        return None
    shape = (cfg.run.steps, cfg.batch.queries, cfg.batch.group_size)
    u = np.random.default_rng([cfg.run.seed, draw]).random(shape)
    out: np.ndarray = np.interp(u, np.linspace(0.0, 1.0, len(qs)), qs)
    return out


def training_work(cal: Calibration, calls: np.ndarray | None) -> np.ndarray | None:
    """Each execution's training work for the simulator, in groups of the calibration's: its planned
    calls over the calls a calibrated group made (an execution cut by the timeout brings, in the
    simulator, the share its progress reached: the calls it made, as the runs' steps trained them); None
    without planned calls or a calibration that counted them."""
    if calls is None or not cal.train_group_calls:
        return None
    return np.asarray(calls, dtype=np.float64) / cal.train_group_calls


def predict(cfg: Config, cal: Calibration, calls: np.ndarray | None = None) -> dict[str, Any]:
    """The simulator's figures for this config's policy (on the run's duration sample). With measured
    seconds past the timeout, `OVERRUN_DRAWS` runs of it, each execution's drawn anew: whether a batch's
    last executions hold their slots long decides when a cell may leave for training, so one draw may land
    on either side of a switch; the figures are the run of median end to end's."""
    w = sim_workload(cfg, cal, calls)
    d = sim_durations(cfg, cal, calls)
    work = training_work(cal, calls)
    runs = [
        run_one(
            w,
            cfg.run.policy,
            streaming=w.driver.streaming,
            durations=d,
            overrun=overruns(cfg, cal, i),
            work=work,
        )
        for i in range(OVERRUN_DRAWS if cal.timeout_overrun_s else 1)
    ]
    r = sorted(runs, key=lambda x: x.end_to_end_h)[len(runs) // 2]
    return {
        "end_to_end_s": r.end_to_end_h * 3600.0,
        "idle_rollout": r.idle_rollout,
        "idle_training": r.idle_training,
        "switching_share": r.switching_share,
        "idle_total": r.idle_total,
        "staleness_mean": r.staleness_mean,
        "staleness_max": r.staleness_max,
        "switches": r.switches,
        "timeouts": r.timeouts,
    }


def with_policy(cfg: Config, policy: str) -> Config:
    return replace(cfg, run=replace(cfg.run, policy=policy))
