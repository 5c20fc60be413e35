"""The simulator, calibrated on the three policies' runs of the agent-shaped workload on one H200, at other
execution timeouts, staleness bounds and model-call speeds: where elastic, Colocate and Async part.

The calibration is the one `gyre compare --reuse` makes from those runs' metrics.json
(`metrics-h200-agentic-1206-{elastic,colocate,async}.json`, `integration/examples/h200-agentic.toml`):
training seconds a group by training cells, switches, the push, seconds a model call takes at full
speed, and the seconds past the timeout at which cut executions ended. Each setting changes the config's
`[agent] timeout_s` and `[driver] max_ahead`, and scales the calibrated seconds a call (`--call-scale`:
0.87 is a call at the 13% more output tokens a second that one engine alone gained on one H100 from the
fused RMS norms, `packages/gyre-engine/bench/results-h100-agentic-load-norms.json`), then predicts each
policy's end to end. Writes per setting: elastic's end to end, Colocate's and Async's against it, and
the executions the timeout cut in elastic's run; the table goes to stdout.

    uv run python integration/bench/sim_settings.py --out integration/bench/results-sim-settings.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from gyre.config.runconfig import Config, load_config
from gyre.measure import predict as sim
from gyre.scenarios.compare import planned_calls

HERE = Path(__file__).resolve().parent
POLICIES = ("elastic", "colocate", "async")


def table(
    cfg: Config,
    measured: list[dict[str, Any]],
    timeouts: list[float],
    aheads: list[int],
    scales: list[float],
) -> tuple[sim.Calibration, list[dict[str, Any]]]:
    """The calibration on `measured` (the runs' metrics, as `gyre compare --reuse` makes it) and one row
    per (call scale, timeout, batches ahead): each policy's predicted end to end and the ratios."""
    calls, slept = planned_calls(cfg)
    if calls is None:
        raise SystemExit(
            f"{cfg.agent.harness!r} harness: the table needs the profile harness's planned calls"
        )
    cal = sim.calibrate(measured, calls, slept)
    if cal.model_call_s is None:
        raise SystemExit("the runs' metrics give no seconds a call (no outcomes with calls)")
    rows: list[dict[str, Any]] = []
    for scale in scales:
        c_cal = replace(cal, model_call_s=cal.model_call_s * scale)
        for t in timeouts:
            for ahead in aheads:
                c = replace(
                    cfg, agent=replace(cfg.agent, timeout_s=t), driver=replace(cfg.driver, max_ahead=ahead)
                )
                got = {pol: sim.predict(c.with_policy(pol, c.run.out_dir), c_cal, calls) for pol in POLICIES}
                e = got["elastic"]["end_to_end_s"]
                rows.append(
                    {
                        "call_scale": scale,
                        "timeout_s": t,
                        "max_ahead": ahead,
                        "end_to_end_s": {pol: round(g["end_to_end_s"], 1) for pol, g in got.items()},
                        "colocate_over_elastic": round(got["colocate"]["end_to_end_s"] / e, 3),
                        "async_over_elastic": round(got["async"]["end_to_end_s"] / e, 3),
                        "elastic_cut": got["elastic"]["timeouts"],
                        "executions": int(calls.size),
                    }
                )
    return cal, rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=HERE.parent / "examples" / "h200-agentic.toml")
    p.add_argument("--metrics", default="metrics-h200-agentic-1206-{policy}.json", help="in bench/")
    p.add_argument("--timeouts", default="120,150,180,240")
    p.add_argument("--ahead", default="2,1")
    p.add_argument("--call-scale", default="1.0,0.87")
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    cfg = load_config(a.config)
    measured = [json.loads((HERE / a.metrics.format(policy=pol)).read_text()) for pol in POLICIES]
    cal, rows = table(
        cfg,
        measured,
        [float(x) for x in a.timeouts.split(",")],
        [int(x) for x in a.ahead.split(",")],
        [float(x) for x in a.call_scale.split(",")],
    )
    print(
        "| call scale | timeout, batches ahead | elastic | colocate / elastic | async / elastic | cut | slowest |"
    )
    for r in rows:
        print(
            f"| {r['call_scale']:.2f} | {r['timeout_s']:.0f} s, {r['max_ahead']} "
            f"| {r['end_to_end_s']['elastic']:.1f} s | {r['colocate_over_elastic']:.3f} "
            f"| {r['async_over_elastic']:.3f} | {r['elastic_cut']} of {r['executions']} "
            f"| {max(r['end_to_end_s'].values()):.0f} s |"
        )
    out = {
        "bench": "sim_settings",
        "config": a.config.name,
        "metrics": [a.metrics.format(policy=pol) for pol in POLICIES],
        "calibration": asdict(cal),
        "rows": rows,
    }
    if a.out is not None:
        a.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
