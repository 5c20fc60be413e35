"""Running code in Triton's CPU interpreter: a subprocess with TRITON_INTERPRET=1 (the interpreter is
chosen when Triton loads), started in this directory so that it imports the tests' helpers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


def interpret(code: str, timeout: float) -> str:
    """Run `code` (dedented) in the interpreter; its stdout. Skips without Triton; fails on a non-zero exit."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(Path(__file__).parent),
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return res.stdout
