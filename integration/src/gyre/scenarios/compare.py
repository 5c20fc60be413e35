"""`gyre compare CONFIG`: one workload under several arms (a policy, optionally with streaming forced on
or off), measured side by side, with the gyre-sched simulator's prediction for the same configuration
next to each measurement.

An arm is `POLICY` (the config's `[driver] streaming`), `POLICY:streaming` or `POLICY:whole` (whole steps).
Each arm gets `repeats` full `gyre run`s (fresh processes, the same seed, so the same tasks and the same
duration sample) in `out_dir/<arm>/` (one repeat) or `out_dir/<arm>/r<i>/`; the figures of an arm are
medians over its repeats. Afterwards the machine-dependent times the simulator needs (cell-seconds of
training per group, weight push, switch times, seconds per model call) are taken from every measured run
(medians) and the simulator runs each arm on the same duration sample, with the arm's streaming. The
table and `compare.json` hold both, and the end-to-end ratios against the first arm.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from gyre.config.runconfig import POLICIES, Config, ConfigError
from gyre.measure import predict as sim
from gyre.measure.metrics import write_json
from gyre.procs.group import ProcessGroup
from gyre.system.run import RunError, ensure_model, run

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


def _arm_dir(root: Path, arm: str, i: int, repeats: int) -> Path:
    d = root / arm.replace(":", "-")
    return d if repeats == 1 else d / f"r{i}"


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


def compare(
    cfg: Config, arms: list[str], say: Any = print, reuse: bool = False, repeats: int = 1
) -> dict[str, Any]:
    """Run each arm `repeats` times (or, with `reuse`, read the `metrics.json` of earlier runs, e.g. made on
    another machine), then predict each with the simulator and tabulate."""
    if repeats < 1:
        raise ConfigError("repeats must be >= 1")
    root = Path(cfg.run.out_dir).resolve()
    configs = {a: arm_config(cfg, a, str(root)) for a in arms}  # refuses a bad arm before anything runs
    if not reuse and not cfg.run.model_dir:  # one embedded model for every run
        procs = ProcessGroup(root / "logs")
        try:
            model = ensure_model(cfg, root, procs)
        finally:
            procs.close()
        configs = {a: replace(c, run=replace(c.run, model_dir=str(model))) for a, c in configs.items()}
    measured: dict[str, list[dict[str, Any]]] = {}
    for i in range(repeats):  # repeat-major: the machine's load drifts over every arm alike
        for a, c in configs.items():
            d = _arm_dir(root, a, i, repeats)
            if reuse:
                if not (d / "metrics.json").exists():
                    raise RunError(
                        f"--reuse: no {d / 'metrics.json'}; run `gyre compare --policies {a}` first"
                    )
                m = json.loads((d / "metrics.json").read_text())
            else:
                say(f"gyre compare: {a}, run {i + 1} of {repeats}")
                m = run(c.with_policy(c.run.policy, str(d)), say=say)
            measured.setdefault(a, []).append(m)
    cal = sim.calibrate([m for ms in measured.values() for m in ms])
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
                "predicted": sim.predict(configs[a], cal),
            }
        )
    ratios: dict[str, float] = {}
    base = rows[0]
    for r in rows[1:]:
        for kind in ("measured", "predicted"):
            ratios[f"{r['arm']}/{base['arm']} {kind}"] = round(
                r[kind]["end_to_end_s"] / base[kind]["end_to_end_s"], 3
            )
    result = {
        "calibration": asdict(cal),
        "repeats": repeats,
        "rows": rows,
        "ratios": ratios,
        "config": cfg.to_dict(),
    }
    root.mkdir(parents=True, exist_ok=True)
    write_json(root / "compare.json", result)
    say(table(rows))
    for k, v in ratios.items():
        say(f"{k}: {v:.3f}")
    say(f"calibration (measured medians fed to the simulator): {asdict(cal)}")
    say(f"written: {root / 'compare.json'}")
    return result
