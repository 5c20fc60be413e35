"""`package_version`: installed metadata first, else the pyproject.toml of the source tree the module sits
in (src layout), else "0+unknown"; gyre-base reports its own version through it."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

import gyre_base
from gyre_base.version import UNKNOWN, package_version


def _tree(root: Path, name: str, version: str) -> str:
    """A source tree of distribution `name` (never installed) and its package's `__init__.py`."""
    init = root / "src" / name.replace("-", "_") / "__init__.py"
    init.parent.mkdir(parents=True)
    init.write_text("")
    (root / "pyproject.toml").write_text(f'[project]\nname = "{name}"\nversion = "{version}"\n')
    return str(init)


def test_installed_metadata_comes_first() -> None:
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert gyre_base.__version__ == importlib.metadata.version("gyre-base") == pyproject["project"]["version"]


def test_a_source_tree_reports_its_pyproject(tmp_path: Path) -> None:
    init = _tree(tmp_path, "gyre-not-installed", "7.1.2")
    assert package_version("gyre-not-installed", init) == "7.1.2"


def test_neither_installed_nor_in_its_tree_is_unknown(tmp_path: Path) -> None:
    init = _tree(tmp_path, "gyre-other-name", "7.1.2")
    assert package_version("gyre-not-installed", init) == UNKNOWN  # another project's pyproject
    loose = tmp_path / "a" / "b" / "c.py"
    loose.parent.mkdir(parents=True)
    assert package_version("gyre-not-installed", str(loose)) == UNKNOWN


def test_the_command_reports_it() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "gyre_base", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == f"gyre-base {gyre_base.__version__}"
    token = subprocess.run(
        [sys.executable, "-m", "gyre_base", "token"], capture_output=True, text=True, timeout=60, check=True
    )
    assert len(token.stdout.strip()) == 43
