"""`gyre compare CONFIG`: one workload under elastic, colocate and async, measured side by side, with the
gyre-sched simulator's prediction for the same configuration next to each measurement.

Each policy gets a full `gyre run` (fresh processes, the same seed, so the same tasks and the same
duration sample) in `out_dir/<policy>/`. Afterwards the machine-dependent times the simulator needs
(cell-seconds of training per group, weight push, switch times) are taken from the measured runs
(medians over all three) and the simulator runs each policy on the same duration sample. The table and
`compare.json` hold both, and the end-to-end ratios against elastic.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from gyre import predict as sim
from gyre.config import Config
from gyre.metrics import write_json
from gyre.procs import ProcessGroup
from gyre.run import RunError, ensure_model, run


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
        "| policy | end-to-end s (measured / simulated) | idle rollout | idle training | switching | "
        "switches | mean / max staleness | timeouts |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m, p = r["measured"], r["predicted"]
        lines.append(
            f"| {r['policy']} | {m['end_to_end_s']:.1f} / {p['end_to_end_s']:.1f} "
            f"| {_fmt(m['idle_rollout'], True)} / {_fmt(p['idle_rollout'], True)} "
            f"| {_fmt(m['idle_training'], True)} / {_fmt(p['idle_training'], True)} "
            f"| {_fmt(m['switching_share'], True)} / {_fmt(p['switching_share'], True)} "
            f"| {m['switches']} / {p['switches']} "
            f"| {m['staleness_mean']:.2f} / {m['staleness_max']} (sim {p['staleness_mean']:.2f} / {p['staleness_max']:.0f}) "
            f"| {m['timeouts']} / {p['timeouts']} |"
        )
    return "\n".join(lines)


def compare(cfg: Config, policies: list[str], say: Any = print, reuse: bool = False) -> dict[str, Any]:
    """Run each policy (or, with `reuse`, read `out_dir/<policy>/metrics.json` of an earlier run, e.g.
    one made on another machine), then predict each with the simulator and tabulate."""
    root = Path(cfg.run.out_dir).resolve()
    if not reuse and not cfg.run.model_dir:  # one embedded model for all policies
        procs = ProcessGroup(root / "logs")
        try:
            model = ensure_model(cfg, root, procs)
        finally:
            procs.close()
        cfg = replace(cfg, run=replace(cfg.run, model_dir=str(model)))
    measured: dict[str, dict[str, Any]] = {}
    for p in policies:
        if reuse:
            path = root / p / "metrics.json"
            if not path.exists():
                raise RunError(f"--reuse: no {path}; run `gyre compare --policies {p}` first")
            measured[p] = json.loads(path.read_text())
        else:
            measured[p] = run(cfg.with_policy(p, str(root / p)), say=say)
    cal = sim.calibrate(list(measured.values()))
    rows: list[dict[str, Any]] = []
    for p, m in measured.items():
        roles = m["roles"]
        rows.append(
            {
                "policy": p,
                "measured": {
                    "end_to_end_s": m["end_to_end_s"],
                    "idle_rollout": roles["idle_rollout"],
                    "idle_training": roles["idle_training"],
                    "switching_share": roles["switching_share"],
                    "idle_total": roles["idle_total"],
                    "switches": m["switches"],
                    "staleness_mean": m["staleness_mean"],
                    "staleness_max": m["staleness_max"],
                    "timeouts": m["timeouts"],
                },
                "predicted": sim.predict(cfg.with_policy(p, str(root / p)), cal),
            }
        )
    ratios: dict[str, float] = {}
    by = {r["policy"]: r for r in rows}
    if "elastic" in by:
        for p in ("colocate", "async"):
            if p in by:
                for kind in ("measured", "predicted"):
                    ratios[f"{p}/elastic {kind}"] = round(
                        by[p][kind]["end_to_end_s"] / by["elastic"][kind]["end_to_end_s"], 3
                    )
    result = {"calibration": asdict(cal), "rows": rows, "ratios": ratios, "config": cfg.to_dict()}
    root.mkdir(parents=True, exist_ok=True)
    write_json(root / "compare.json", result)
    say(table(rows))
    for k, v in ratios.items():
        say(f"{k}: {v:.3f}")
    say(f"calibration (measured medians fed to the simulator): {asdict(cal)}")
    say(f"written: {root / 'compare.json'}")
    return result
