"""Seconds the prefix cache's ideal (`gyre.measure.prefixes.prefix_hits`) takes on a run's records: part of
the figures `gyre run` computes at its end. Takes a run's `records.msgpack`, or a run archive made by
`h200_agentic.py` (`run-<policy>.tar.xz`, which holds it); by default the tiny CPU run's records the tests
use.

    uv run python integration/bench/prefix_time.py .runs/run-elastic.tar.xz \
        --out integration/bench/results-prefix-time.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tarfile
import tempfile
import time
from pathlib import Path

from gyre.measure import prefixes
from gyre_traj.io import read_records
from gyre_traj.records import Call

DEFAULT = Path(__file__).resolve().parents[1] / "tests" / "data" / "agentic-tiny" / "records-elastic.msgpack"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("records", nargs="?", default=str(DEFAULT), help="records.msgpack or a run-*.tar.xz")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="", help="results JSON (default: print only)")
    a = p.parse_args()
    src = Path(a.records)
    with tempfile.TemporaryDirectory() as tmp:
        path = src
        if src.name.endswith(".tar.xz"):
            with tarfile.open(src, "r:xz") as tar:
                tar.extract("records.msgpack", tmp, filter="data")
            path = Path(tmp) / "records.msgpack"
        calls = [r for r in read_records(path) if isinstance(r, Call)]
    times, got = [], {}
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        got = prefixes.prefix_hits(calls)
        times.append(time.perf_counter() - t0)
    row = {"records": src.name, "calls": len(calls), "input_tokens": got["input_tokens"],
           "prefix_hits_s_median": round(statistics.median(times), 3), "repeats": a.repeats,
           "prefix_cache_hit_share_ideal": got["prefix_cache_hit_share_ideal"]}  # fmt: skip
    print(json.dumps(row))
    if a.out:
        Path(a.out).write_text(json.dumps(row, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
