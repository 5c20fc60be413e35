"""On a machine without Debian's libibverbs1 the tests that move bytes over Mooncake skip, saying what to
install; under GYRE_REQUIRE_MOONCAKE=1 (CI, which installs it) they fail instead of skipping."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

NO_LIBIBVERBS = "libibverbs.so.1: cannot open shared object file: No such file or directory"


@pytest.mark.slow
@pytest.mark.parametrize("required", [False, True], ids=["skips", "fails-under-GYRE_REQUIRE_MOONCAKE"])
def test_mooncake_tests_skip_naming_libibverbs1_where_it_is_missing_and_fail_in_ci(
    tmp_path: Path, required: bool
) -> None:
    """The missing library is simulated whatever this machine has: a `mooncake` package on PYTHONPATH
    whose engine fails to import with the error the real wheel gives there. A marked test, run by pytest
    in a subprocess, is skipped with the apt-get line, or fails with it under GYRE_REQUIRE_MOONCAKE=1."""
    (tmp_path / "mooncake").mkdir()
    (tmp_path / "mooncake" / "__init__.py").write_text("")
    (tmp_path / "mooncake" / "engine.py").write_text(f"raise ImportError({NO_LIBIBVERBS!r})\n")
    env = {k: v for k, v in os.environ.items() if k != "GYRE_REQUIRE_MOONCAKE"}
    env["PYTHONPATH"] = str(tmp_path)
    if required:
        env["GYRE_REQUIRE_MOONCAKE"] = "1"
    node = f"{Path(__file__).with_name('test_core.py')}::test_chunked_microbatches_in_the_core_and_a_satellite_match_unchunked"
    r = subprocess.run(
        [sys.executable, "-m", "pytest", node, "-q", "-rse", "-p", "no:cacheprovider"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "apt-get install -y libibverbs1" in r.stdout, r.stdout + r.stderr
    if required:
        assert r.returncode == 1 and "1 error" in r.stdout, r.stdout
    else:
        assert r.returncode == 0 and "1 skipped" in r.stdout, r.stdout
