"""`bench/h200_agentic.py --plan`: a device call's phases planned without running them, for the config
with keys overridden on the command line (`SECTION.KEY=VALUE`, checked as the file is)."""

from __future__ import annotations

import subprocess
import sys

from .benchmods import BENCH


def _plan(*args: str, out: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH / "h200_agentic.py"), "--plan", "--out", out, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_overrides_reach_the_plan(tmp_path) -> None:  # type: ignore[no-untyped-def]
    res = _plan("--policies", "async", "agent.timeout_s=150", "driver.max_ahead=1", out=str(tmp_path))
    assert "with agent.timeout_s=150 driver.max_ahead=1: timeout 150 s, 1 batches ahead" in res.stdout
    assert "plan: run-async" in res.stdout and "deadline about" in res.stdout
    plain = _plan("--policies", "async", out=str(tmp_path))
    assert "timeout 120 s, 2 batches ahead" in plain.stdout


def test_an_unknown_key_is_refused_before_anything_runs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    res = _plan("agent.timeout=150", out=str(tmp_path))
    assert res.returncode != 0
    assert (
        "unknown key 'timeout'" in res.stderr and "Traceback" not in res.stderr and "plan:" not in res.stdout
    )


def _run_s(out: str, policy: str) -> float:
    line = next(x for x in out.splitlines() if f"plan: run-{policy} " in x)
    return float(line.split(f"plan: run-{policy} ")[1].split(" s")[0])


def test_a_changed_config_plans_its_runs_from_the_simulator(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A run measured at a 120 s timeout says little of one at 150 s: with overrides the plan takes each run
    from the simulator's end to end for this call's config (calibrated on each policy's newest complete run
    in bench/), so the longer timeout plans a longer run; a budget that leaves its deadline short of the
    simulated end to end is warned of before anything runs."""
    args = ("--policies", "colocate", "--skip", "probe,migrate,replay,train,floors", "--warmstart-steps", "0")
    plain = _plan(*args, out=str(tmp_path)).stdout
    longer = _plan(*args, "agent.timeout_s=150", "driver.max_ahead=1", out=str(tmp_path)).stdout
    assert _run_s(longer, "colocate") > _run_s(plain, "colocate") + 60.0
    assert "WARNING" not in plain
    short = _plan(*args, "--budget-s", "450", "agent.timeout_s=150", "driver.max_ahead=1", out=str(tmp_path))
    assert "WARNING: run-colocate's end to end as simulated" in short.stdout
