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
