from __future__ import annotations

import subprocess
import sys

import pytest
from gyre.cli import main


def test_version_lists_components(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version"]) == 0
    out = capsys.readouterr().out
    import importlib.metadata

    assert f"gyre-traj    {importlib.metadata.version('gyre-traj')}" in out


def test_help_runs_as_a_command() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gyre.cli", "--help"], capture_output=True, text=True, check=True, timeout=60
    )
    assert "gyre-traj" in proc.stdout
