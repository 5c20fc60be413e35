"""The `gyre` command's surface: `version`, and every command's `--help` in the workspace (each console
script of each member, and each of its subcommands) prints its help and exits 0."""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

import pytest
from gyre.cli import main

WORKSPACE = ("gyre", "gyre-traj", "gyre-sched", "gyre-xfer", "gyre-engine", "gyre-proxy", "gyre-train")
"""The distributions of the workspace; each console script of theirs is checked."""


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


def _help(entry: Callable[[list[str]], Any], argv: list[str]) -> str:
    """What `SCRIPT *argv --help` prints; it must exit 0 (anything else, a crash included, fails)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as ended:
        entry([*argv, "--help"])
    assert ended.value.code in (0, None), f"{argv} --help exited {ended.value.code}"
    return out.getvalue()


def _subcommands(help_text: str) -> list[str]:
    """The subcommands an argparse help lists (its positional `{a,b,...}` line)."""
    found = re.search(r"^ {2}\{([\w,-]+)\}", help_text, re.MULTILINE)
    return found.group(1).split(",") if found else []


def test_every_command_of_the_workspace_has_a_working_help() -> None:
    """Every console script of the workspace's distributions, and each of its subcommands (two levels),
    run with `--help` as its entry point runs: help printed, exit status 0."""
    scripts = {
        ep.name: ep
        for ep in entry_points(group="console_scripts")
        if ep.dist is not None and ep.dist.name in WORKSPACE
    }
    assert sorted(scripts) == sorted(WORKSPACE)  # one script per distribution, named after it
    checked = []
    for name, ep in sorted(scripts.items()):
        entry = ep.load()
        top = _help(entry, [])
        assert "usage:" in top, name
        subs = _subcommands(top)
        assert subs, f"{name} lists no subcommand"
        for sub in subs:
            text = _help(entry, [sub])
            assert "usage:" in text, f"{name} {sub}"
            checked.append(f"{name} {sub}")
            for inner in _subcommands(text):
                assert "usage:" in _help(entry, [sub, inner]), f"{name} {sub} {inner}"
                checked.append(f"{name} {sub} {inner}")
    assert {"gyre warmstart", "gyre demo", "gyre run", "gyre-train core", "gyre-xfer token"} <= set(checked)
