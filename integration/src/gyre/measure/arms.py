"""The arms of a comparison (`gyre compare`) and their table: what each measured run contributes, the
medians of an arm's repeats beside the gyre-sched simulator's prediction for the same configuration, and
the end-to-end ratios against the first arm.

An arm is `POLICY` (the config's `[driver] streaming`), `POLICY:streaming` or `POLICY:whole` (whole steps).
The simulator is calibrated once from every measured run (`predict.calibrate`: the machine-dependent
times it cannot know) and predicts each arm on the same duration sample, with the arm's streaming.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, replace
from typing import Any

import numpy as np

from gyre.config.runconfig import POLICIES, Config, ConfigError
from gyre.measure import predict as sim

FIGURES = (
    "end_to_end_s", "idle_rollout", "idle_training", "switching_share", "idle_total", "switches",
    "staleness_mean", "staleness_max", "timeouts", "train_overlap_share",
)  # fmt: skip
"""What each run contributes to its arm's row (the arm's value: the median over its repeats)."""


def arm_config(cfg: Config, arm: str, out_dir: str) -> Config:
    """The config of one arm: `policy`, `policy:streaming` or `policy:whole`."""
    policy, _, mode = arm.partition(":")
    if policy not in POLICIES or mode not in ("", "streaming", "whole"):
        raise ConfigError(
            f"arm {arm!r}: use POLICY[:streaming|:whole] with a policy of {', '.join(POLICIES)}"
        )
    c = cfg.with_policy(policy, out_dir)
    if mode:
        c = replace(c, driver=replace(c.driver, streaming=mode == "streaming"))
    return c


def _figures(m: dict[str, Any]) -> dict[str, Any]:
    roles = m["roles"]
    return {k: roles[k] if k in roles else m.get(k) for k in FIGURES}


def _median(values: list[Any]) -> Any:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _fmt(v: Any, pct: bool = False) -> str:
    if v is None:
        return "-"
    if pct:
        return f"{100 * v:.0f}%"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| arm | end-to-end s: median (runs) / simulated | overlap | idle rollout | idle training | "
        "switching | switches | mean / max staleness | timeouts |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m, p = r["measured"], r["predicted"]
        runs = ", ".join(f"{x['end_to_end_s']:.1f}" for x in r["repeats"])
        lines.append(
            f"| {r['arm']} | {m['end_to_end_s']:.1f} ({runs}) / {p['end_to_end_s']:.1f} "
            f"| {_fmt(m['train_overlap_share'], True)} "
            f"| {_fmt(m['idle_rollout'], True)} / {_fmt(p['idle_rollout'], True)} "
            f"| {_fmt(m['idle_training'], True)} / {_fmt(p['idle_training'], True)} "
            f"| {_fmt(m['switching_share'], True)} / {_fmt(p['switching_share'], True)} "
            f"| {_fmt(m['switches'])} / {p['switches']} "
            f"| {_fmt(m['staleness_mean'])} / {_fmt(m['staleness_max'])} "
            f"(sim {p['staleness_mean']:.2f} / {p['staleness_max']:.0f}) "
            f"| {_fmt(m['timeouts'])} / {p['timeouts']} |"
        )
    return "\n".join(lines)


def tabulate(
    cfg: Config,
    configs: dict[str, Config],
    measured: dict[str, list[dict[str, Any]]],
    repeats: int,
    calls: np.ndarray | None = None,
) -> dict[str, Any]:
    """The comparison of the arms `configs` from their measured runs (`metrics.json` of each repeat): per
    arm the medians and each repeat, the simulator's prediction, the calibration and the ratios
    (`calls`: each execution's planned calls, when the harness plans them)."""
    cal = sim.calibrate([m for ms in measured.values() for m in ms], calls)
    rows: list[dict[str, Any]] = []
    for a, ms in measured.items():
        reps = [_figures(m) for m in ms]
        rows.append(
            {
                "arm": a,
                "policy": configs[a].run.policy,
                "streaming": configs[a].streams,
                "measured": {k: _median([r[k] for r in reps]) for k in FIGURES},
                "repeats": reps,
                "predicted": sim.predict(configs[a], cal, calls),
            }
        )
    ratios: dict[str, float] = {}
    base = rows[0]
    for r in rows[1:]:
        for kind in ("measured", "predicted"):
            ratios[f"{r['arm']}/{base['arm']} {kind}"] = round(
                r[kind]["end_to_end_s"] / base[kind]["end_to_end_s"], 3
            )
    return {
        "calibration": asdict(cal),
        "repeats": repeats,
        "rows": rows,
        "ratios": ratios,
        "config": cfg.to_dict(),
    }
