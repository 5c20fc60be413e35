"""Seconds `gyre run` spends drawing its timeline (`gyre.measure.metrics.write_plot`) at the end of a run,
for runs of several lengths sampled as a run samples them: two cells, their roles every 0.2 s (the
sampler's interval), the core's status every 0.05 s. Each cell switches role every 100 or 140 s, its engine
is busy in two of three samples, the core in four of five: more stretches than a real run has, so more
bars to draw.

    uv run python integration/bench/plot_time.py --out integration/bench/results-plot-time.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from gyre.measure.metrics import role_bars, write_plot
from gyre.measure.samples import Sample
from gyre.measure.trainwatch import TrainSample, TrainTrack
from gyre_sched.protocol import Role

T0 = 1.8e9  # epoch seconds, as a run's samples carry them


def synthetic_run(seconds: float) -> tuple[dict[str, Any], list[Sample], TrainTrack]:
    r, t = int(Role.ROLLOUT), int(Role.TRAINING)
    n = int(seconds / 0.2)
    samples = [
        Sample(T0 + i * 0.2, {0: r if (i // 500) % 2 == 0 else t, 1: r if (i // 700) % 2 == 0 else t},
               {0: i % 3 != 0, 1: i % 3 != 1}, {0: "0", 1: "0"})
        for i in range(n)
    ]  # fmt: skip
    track = TrainTrack([TrainSample(T0 + i * 0.05, 0, i % 5 != 0) for i in range(4 * n)])
    metrics = {"t0": T0, "roles": {"per_cell": {"0": {}, "1": {}}}, "steps": [], "outcomes": [],
               "end_to_end_s": seconds, "policy": "elastic"}  # fmt: skip
    return metrics, samples, track


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", default="330,3600", help="comma list of run lengths")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="", help="results JSON (default: print only)")
    a = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for secs in (float(x) for x in a.seconds.split(",")):
            metrics, samples, track = synthetic_run(secs)
            bars = sum(len(v) for v in role_bars(samples, track).values())
            times = []
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                write_plot(metrics, samples, track, Path(tmp) / "timeline.png")
                times.append(time.perf_counter() - t0)
            rows.append({"run_s": secs, "samples": len(samples), "core_samples": len(track.samples),
                         "bars": bars, "plot_s_median": round(statistics.median(times), 3)})  # fmt: skip
            print(
                f"{secs:7.0f} s run: {len(samples)} samples, {bars} bars, plot {rows[-1]['plot_s_median']} s"
            )
    if a.out:
        Path(a.out).write_text(json.dumps({"rows": rows, "repeats": a.repeats}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
