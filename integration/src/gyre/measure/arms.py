"""The arms of a comparison (`gyre compare`) and their table: what each measured run contributes, the
medians of an arm's repeats beside the gyre-sched simulator's prediction for the same configuration, and
the end-to-end ratios against the first arm.

An arm is `POLICY` (the config's `[driver] streaming`), `POLICY:streaming` or `POLICY:whole` (whole steps).
The simulator is calibrated once from every measured run (`predict.calibrate`: the machine-dependent
times it cannot know) and predicts each arm on the same duration sample, with the arm's streaming.
`against_prediction` holds a table to the simulator: each arm's measured / simulated end to end, and each
end-to-end ratio against the first arm measured / as simulated, within a tolerance (15%).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, replace
from typing import Any

import numpy as np

from gyre.config.runconfig import POLICIES, Config, ConfigError
from gyre.measure import predict as sim

TOLERANCE = 0.15
"""How far a measured ratio may be from the simulator's (relative) and still agree with it."""

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
    slept: sim.Slept | None = None,
) -> dict[str, Any]:
    """The comparison of the arms `configs` from their measured runs (`metrics.json` of each repeat): per
    arm the medians and each repeat, the simulator's prediction, the calibration and the ratios
    (`calls`: each execution's planned calls, and `slept`: the tool time slept before a number of calls,
    when the harness plans them)."""
    cal = sim.calibrate([m for ms in measured.values() for m in ms], calls, slept)
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


def against_prediction(result: dict[str, Any], tolerance: float = TOLERANCE) -> dict[str, Any]:
    """A `tabulate` result held to the simulator: per arm `sim_end_to_end_s`, `sim_ratio` (measured /
    simulated end to end) and `within` (|sim_ratio - 1| <= tolerance); per arm after the first, the
    end-to-end ratio against the first arm measured and simulated, their quotient `off` and `within`
    (|off - 1| <= tolerance). A figure missing (a run without end_to_end_s) leaves None."""

    def ratio(a: Any, b: Any) -> float | None:
        return round(a / b, 4) if a is not None and b else None

    def within(r: float | None) -> bool | None:
        return None if r is None else abs(r - 1.0) <= tolerance

    arms: dict[str, dict[str, Any]] = {}
    for row in result["rows"]:
        m, p = row["measured"]["end_to_end_s"], row["predicted"]["end_to_end_s"]
        r = ratio(m, p)
        arms[row["arm"]] = {
            "end_to_end_s": m,
            "sim_end_to_end_s": round(p, 3),
            "sim_ratio": r,
            "within": within(r),
        }
    pairs: dict[str, dict[str, Any]] = {}
    base: str = result["rows"][0]["arm"] if result["rows"] else ""
    for a, f in arms.items():
        if a == base:
            continue
        b = arms[base]
        meas, sim = (
            ratio(f["end_to_end_s"], b["end_to_end_s"]),
            ratio(f["sim_end_to_end_s"], b["sim_end_to_end_s"]),
        )
        off = ratio(meas, sim)
        pairs[f"{a}/{base}"] = {"measured": meas, "simulated": sim, "off": off, "within": within(off)}
    return {"tolerance": tolerance, "arms": arms, "ratios": pairs}
