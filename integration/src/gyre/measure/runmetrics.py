"""The metrics of a finished `gyre run` attempt (`metrics.json`): per applied step what the core trained
and when (its `steps.jsonl` lines, with the train-inference mismatch of its on-policy tokens), how long
the new version took to reach the serving engines, what the trajectory service handed over for it; over
the run the cells' role accounting, training overlap, switches and their times, the cells in rollout over
time, staleness, the executions' outcomes and the held-out evaluations.

Everything comes in as data: the core's `steps.jsonl` in the run directory, the sampler's readings
(`metrics.Sampler`), the driver's outcomes and the trajectory service's step summaries and counts. A step
made by an earlier attempt of the run has its summary from the ledger (the caller merges them).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gyre_sched.protocol import Action, Role

from gyre.config.runconfig import Config
from gyre.measure.metrics import Sampler, role_accounting
from gyre.measure.samples import Sample, at_least
from gyre.measure.trainwatch import train_overlap

SUMMARY_KEYS = (
    "executions", "trained_executions", "eval_failed", "timed_out", "mean_score", "tokens", "loss_tokens",
    "output_tokens_recorded", "leaves_by_role", "jmax_dropped", "first_given_at", "closed_at",
)  # fmt: skip
"""What each step's row takes from the trajectory service's summary of the step."""


def read_steps(out: Path) -> list[dict[str, Any]]:
    """The core's `steps.jsonl` lines in the run directory `out` (none yet: [])."""
    p = out / "steps.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []


def switch_times(samples: Sequence[Sample]) -> dict[str, list[float]]:
    """Seconds from leaving a role to arriving in the other, per switch (sampling resolution)."""
    out: dict[str, list[float]] = {"to_training_s": [], "to_rollout_s": []}
    left: dict[int, tuple[float, int]] = {}
    prev: dict[int, int] = {}
    for s in samples:
        for cid, r in s.roles.items():
            p = prev.get(cid)
            if p == int(Role.ROLLOUT) and r != p:
                left[cid] = (s.t, int(Role.TRAINING))
            elif p == int(Role.TRAINING) and r != p:
                left[cid] = (s.t, int(Role.ROLLOUT))
            if cid in left and r == left[cid][1]:
                t, to = left.pop(cid)
                out["to_training_s" if to == int(Role.TRAINING) else "to_rollout_s"].append(round(s.t - t, 3))
            prev[cid] = r
    return out


def rollout_cells(samples: Sequence[Sample], t0: float) -> list[list[float]]:
    """[seconds from `t0`, cells in rollout] at the first sample that has cells and wherever the count
    changes: the rollout capacity over the run, which the simulator's calibration reads
    (`predict.run_speed`)."""
    out: list[list[float]] = []
    for s in samples:
        if not s.roles:  # before any cell registered
            continue
        n = sum(r == int(Role.ROLLOUT) for r in s.roles.values())
        if not out or out[-1][1] != n:
            out.append([round(s.t - t0, 3), n])
    return out


def read_versions(out: Path) -> dict[int, list[dict[str, Any]]]:
    """Each cell's `cells/<id>.versions.jsonl` (the versions its engine took, with wall times), by cell."""
    got: dict[int, list[dict[str, Any]]] = {}
    for p in sorted((out / "cells").glob("*.versions.jsonl")):
        for line in p.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                got.setdefault(int(rec["cell"]), []).append(rec)
    return got


def push_served(
    samples: Sequence[Sample],
    versions: Mapping[int, Sequence[Mapping[str, Any]]],
    t_applied: float,
    version: int,
) -> tuple[float, dict[str, float | None]] | None:
    """(seconds from `version` applied to every engine that was serving rollout then serving it, where
    the slowest of them spent them), from the cells' own records of when their engines took each
    version; None when a serving cell has no such record (the sampled `push_reached` stands then).

    The parts, of the engine that ended the push: `notice_s` from the step applied to its cell holding
    the core's status that names the version (the cell's poll; `status_s` of it waiting for the reply),
    `pull_s` and `apply_s` (the engine's own seconds pulling the snapshot and copying it in between two
    steps, `apply_wait_s` of the latter waiting for the step running then to end; None where the record
    does not say), and `other_s`, the rest (the cell's HTTP call to its engine, the engine's handling of
    it besides pull and apply)."""
    after = [x for x in samples if x.t >= t_applied]
    serving = [cid for cid, ro in after[0].roles.items() if ro == int(Role.ROLLOUT)] if after else []
    if not serving:
        return None
    firsts: list[Mapping[str, Any]] = []
    for cid in serving:
        took = [r for r in versions.get(int(cid), ()) if int(r["version"]) >= version]
        if not took:
            return None
        firsts.append(min(took, key=lambda r: float(r["served"])))
    last = max(firsts, key=lambda r: float(r["served"]))
    push_s = float(last["served"]) - t_applied
    notice_s = float(last["asked"]) - t_applied
    pull_s = float(last["pull_s"])
    apply_s = None if last.get("apply_s") is None else float(last["apply_s"])
    parts: dict[str, float | None] = {
        "notice_s": round(notice_s, 4),
        "status_s": None if last.get("status_s") is None else float(last["status_s"]),
        "pull_s": pull_s,
        "apply_s": apply_s,
        "apply_wait_s": None if last.get("apply_wait_s") is None else float(last["apply_wait_s"]),
        "other_s": round(push_s - notice_s - pull_s - (apply_s or 0.0), 4),
        "pull_s_max": max(float(r["pull_s"]) for r in firsts),
    }
    return push_s, parts


def push_reached(samples: Sequence[Sample], t_applied: float, version: int) -> list[float]:
    """Sample times from which every engine that was serving rollout when `version` was applied serves
    it (engines that were training get it as part of their switch back: `switch_times`, not `push_s`)."""
    after = [x for x in samples if x.t >= t_applied]
    if not after:
        return []
    serving = [cid for cid, ro in after[0].roles.items() if ro == int(Role.ROLLOUT)]
    if not serving:
        return []
    return [x.t for x in after if all(at_least(x.engine_version.get(cid), version) for cid in serving)]


def _step_row(
    cfg: Config,
    r: dict[str, Any],
    samples: Sequence[Sample],
    summaries: Mapping[int, Mapping[str, Any]],
    overlap: dict[str, Any],
    batch_end: dict[int, float],
    versions: Mapping[int, Sequence[Mapping[str, Any]]],
) -> dict[str, Any]:
    """One applied step's row of `metrics.json` from its `steps.jsonl` line `r`."""
    k = int(r["queue_position"]) - 1  # the run's step (a skipped one makes no update: `step` stays)
    summary = summaries.get(k, {})
    v = int(r["version"])
    reached = push_reached(samples, r["t_end"], v)
    sampled = round(reached[0] - r["t_end"], 3) if reached else None
    served = push_served(samples, versions, r["t_end"], v)
    return {
        "step": k,
        "version": v,
        "t_start": r["t_start"],
        "t_end": r["t_end"],
        "elapsed_s": r["elapsed_s"],
        "skipped": bool(r.get("skipped", False)),
        "push_s": round(served[0], 3) if served is not None else sampled,
        "push_sampled_s": sampled,
        "push_pull_s": served[1]["pull_s_max"] if served is not None else None,
        "push_parts": served[1] if served is not None else None,
        "groups": cfg.batch.queries,
        "training_cells": len(r["by_replica"]),
        "by_replica": r["by_replica"],
        "microbatches": r["microbatches"],
        "loss": r["loss"],
        "grad_norm": r["grad_norm"],
        "loss_metrics": r.get("metrics", {}),
        "mismatch": r.get("mismatch", {}),
        "staleness_mean": r["staleness"]["mean"],
        "staleness_max": r["staleness"]["max"],
        "busy_cell_s": 0.0,
        "overlap_cell_s": 0.0,
        "train_first": None,
        **overlap["per_step"].get(str(k), {}),
        "batch_end": batch_end.get(k),
        **{key: summary.get(key) for key in SUMMARY_KEYS},
    }


def collect(
    cfg: Config,
    out: Path,
    t0: float,
    t1: float,
    outcomes: list[dict[str, Any]],
    summaries: Mapping[int, Mapping[str, Any]],
    records: int,
    dropped: int,
    sampler: Sampler,
) -> dict[str, Any]:
    """The metrics of the attempt that ran from `t0` (its first batch) to `t1` (its last step applied):
    `outcomes` are the driver's, `summaries` the trajectory service's per step (this attempt's, and the
    ledger's for earlier ones), `records` and `dropped` its counts of records taken and dropped."""
    samples = sampler.samples
    track = sampler.training()
    overlap = train_overlap(samples, track, outcomes, t0, t1)
    batch_end: dict[int, float] = {}
    for o in outcomes:
        batch_end[o["step"]] = max(batch_end.get(o["step"], 0.0), o["end"])
    versions = read_versions(out)
    steps = [_step_row(cfg, r, samples, summaries, overlap, batch_end, versions) for r in read_steps(out)]
    state = sampler.last_state
    decisions = list(state.decisions) if state is not None else []
    stale = [s["staleness_mean"] for s in steps]
    return {
        "policy": cfg.run.policy,
        "config": cfg.to_dict(),
        "t0": t0,
        "end_to_end_s": round(t1 - t0, 3),
        "steps_applied": len(steps),
        "steps_skipped": sum(s["skipped"] for s in steps),
        "final_version": steps[-1]["version"] if steps else 0,
        "final_cells": {
            str(cid): {"role": Role(r).name.lower(), "engine_version": samples[-1].engine_version.get(cid)}
            for cid, r in sorted(samples[-1].roles.items())
        }
        if samples
        else {},
        "streaming": cfg.streams,
        "roles": role_accounting(samples, track, t0, t1),
        "train_overlap_share": overlap["train_overlap_share"],
        "train_overlap": overlap,
        "switches": len(decisions),
        "switches_to_training": sum(d.action is Action.TO_TRAINING for d in decisions),
        "switch_times": switch_times(samples),
        "rollout_cells": rollout_cells(samples, t0),
        "decisions": [
            {"at": round(d.at, 3), "cell": d.cell_id, "action": d.action.name, "rule": d.rule}
            for d in decisions
        ],
        "staleness_mean": round(sum(stale) / len(stale), 4) if stale else 0.0,
        "staleness_max": max((s["staleness_max"] for s in steps), default=0),
        "mismatch_abs_mean_max": max((s["mismatch"].get("abs_mean", 0.0) for s in steps), default=0.0),
        "executions": len(outcomes),
        "timeouts": sum(o["timed_out"] for o in outcomes),
        "records": records,
        "records_dropped": dropped,
        "evals": [json.loads(x) for x in (out / "evals.jsonl").read_text().splitlines()]
        if (out / "evals.jsonl").exists()
        else [],
        "steps": steps,
        "outcomes": outcomes,
    }
