"""The gate on tests marked `mooncake` (`gyre_xfer.pytest_gate`, loaded for every member's tests by the
workspace's root conftest): on a machine without Debian's libibverbs1 a marked test is skipped, saying
what to install; under GYRE_REQUIRE_MOONCAKE=1 (CI, which installs it) it fails instead; where Mooncake
loads it runs. Each case runs pytest in a subprocess on a test file of its own, with the plugin."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from gyre_xfer.mooncake import unavailable_reason

NO_LIBIBVERBS = "libibverbs.so.1: cannot open shared object file: No such file or directory"
TESTS = """
import pytest


@pytest.mark.mooncake
def test_marked():
    pass


def test_unmarked():
    pass
"""


def run_gated(tmp_path: Path, *, missing: bool, required: bool) -> subprocess.CompletedProcess[str]:
    """pytest on TESTS with the gate; `missing`: a `mooncake` package first on PYTHONPATH whose engine
    fails to import with the error the real wheel gives without libibverbs1, whatever this machine has."""
    tests = tmp_path / "t"
    tests.mkdir()
    (tests / "test_marked.py").write_text(TESTS)
    (tests / "pytest.ini").write_text("[pytest]\nmarkers =\n    mooncake: needs Mooncake\n")
    env = {k: v for k, v in os.environ.items() if k != "GYRE_REQUIRE_MOONCAKE"}
    if missing:
        (tmp_path / "mooncake").mkdir()
        (tmp_path / "mooncake" / "__init__.py").write_text("")
        (tmp_path / "mooncake" / "engine.py").write_text(f"raise ImportError({NO_LIBIBVERBS!r})\n")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    if required:
        env["GYRE_REQUIRE_MOONCAKE"] = "1"
    cmd = [sys.executable, "-m", "pytest", str(tests), "-q", "-rse", "-p", "no:cacheprovider"]
    return subprocess.run(
        [*cmd, "-p", "gyre_xfer.pytest_gate"], cwd=tests, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("required", [False, True], ids=["skips", "fails-under-GYRE_REQUIRE_MOONCAKE"])
def test_a_marked_test_skips_naming_libibverbs1_where_it_is_missing_and_fails_in_ci(
    tmp_path: Path, required: bool
) -> None:
    r = run_gated(tmp_path, missing=True, required=required)
    assert "apt-get install -y libibverbs1" in r.stdout, r.stdout + r.stderr
    if required:
        assert r.returncode == 1 and "1 passed, 1 error" in r.stdout, r.stdout
    else:
        assert r.returncode == 0 and "1 passed, 1 skipped" in r.stdout, r.stdout


def test_a_marked_test_runs_where_mooncake_loads(tmp_path: Path) -> None:
    r = run_gated(tmp_path, missing=False, required=False)
    if unavailable_reason() is None:
        assert r.returncode == 0 and "2 passed" in r.stdout, r.stdout + r.stderr
    else:  # this machine has no Mooncake: the gate says why, as above
        assert r.returncode == 0 and "1 passed, 1 skipped" in r.stdout, r.stdout + r.stderr
