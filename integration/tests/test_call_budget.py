"""The GPU benchmarks' budget counts from the device call's start (`GYRE_CALL_START`, exported by
`bench/h200_run.sh` before the wheels' install and any CUDA tests), not from the script's own start: a call
whose CUDA tests took 70 s once ran its script to a budget that ended past the device's wall limit."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from .benchmods import BENCH, bench_module

h200_run = bench_module("h200_run")


def test_the_budget_counts_from_the_call_start() -> None:
    began = h200_run.call_began({"GYRE_CALL_START": str(time.time() - 70.0)})
    assert 69.0 < time.monotonic() - began < 75.0


def test_without_the_call_start_the_script_start_counts() -> None:
    assert abs(time.monotonic() - h200_run.call_began({})) < 1.0


@pytest.mark.parametrize("offset_s", [None, -7200.0, 600.0])
def test_a_start_that_is_not_one_is_refused(offset_s: float | None) -> None:
    """Not a number, two hours back, ten minutes ahead (taken when the test runs, not when collected)."""
    raw = "yesterday" if offset_s is None else str(time.time() + offset_s)
    with pytest.raises(SystemExit, match="GYRE_CALL_START"):
        h200_run.call_began({"GYRE_CALL_START": raw})


def test_the_plan_counts_the_seconds_before_the_script(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The first run's deadline in the plan is 100 s shorter when the call began 100 s before."""

    def deadline(env_start: str | None) -> int:
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}
        if env_start is not None:
            env["GYRE_CALL_START"] = env_start
        res = subprocess.run(
            [sys.executable, str(BENCH / "h200_agentic.py"), "--plan", "--policies", "elastic", "--out",
             str(tmp_path)],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
        line = next(x for x in res.stdout.splitlines() if "deadline about" in x)
        return int(line.split("deadline about ")[1].split(" s")[0])

    assert 95 <= deadline(None) - deadline(str(time.time() - 100.0)) <= 105
