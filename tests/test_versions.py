"""Every workspace member reports the version its pyproject.toml declares: as `__version__`, as its
command's `--version`, and (gyre-base's `package_version`) from its source tree when not installed. The
version is declared once, in the pyproject; nothing else may say another."""

from __future__ import annotations

import glob
import importlib
import importlib.metadata
import subprocess
import sysconfig
import tomllib
from pathlib import Path

import pytest
from gyre_base.version import package_version

ROOT = Path(__file__).resolve().parents[1]


def _members() -> list[tuple[str, str, str, str]]:
    """(distribution, version, import name, console script) of every workspace member."""
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["uv"]["workspace"]["members"]
    out = []
    for pattern in globs:
        for folder in sorted(glob.glob(str(ROOT / pattern))):
            project = tomllib.loads((Path(folder) / "pyproject.toml").read_text())["project"]
            # src layout: one package each (beside it, setuptools' build metadata of an editable install)
            (src,) = [p for p in (Path(folder) / "src").iterdir() if (p / "__init__.py").exists()]
            (script,) = project["scripts"]
            out.append((project["name"], project["version"], src.name, script))
    return out


MEMBERS = _members()


def test_every_member_is_found() -> None:
    names = {m[0] for m in MEMBERS}
    assert {
        "gyre-base",
        "gyre-traj",
        "gyre-xfer",
        "gyre-sched",
        "gyre-engine",
        "gyre-proxy",
        "gyre-train",
    } <= names
    assert "gyre" in names


@pytest.mark.parametrize(("dist", "version", "module", "script"), MEMBERS, ids=[m[0] for m in MEMBERS])
def test_the_module_reports_the_pyproject_version(dist: str, version: str, module: str, script: str) -> None:
    mod = importlib.import_module(module)
    assert mod.__version__ == version
    assert importlib.metadata.version(dist) == version  # the installed metadata is not stale


@pytest.mark.parametrize(("dist", "version", "module", "script"), MEMBERS, ids=[m[0] for m in MEMBERS])
def test_a_source_tree_reports_the_pyproject_version(
    dist: str, version: str, module: str, script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not installed (metadata hidden), the version comes from the member's own pyproject."""

    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    init = importlib.import_module(module).__file__
    assert init is not None
    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert package_version(dist, init) == version


@pytest.mark.slow
def test_every_command_says_the_pyproject_version() -> None:
    """`<script> --version` of every member, run as the installed console scripts, side by side."""
    bindir = Path(sysconfig.get_path("scripts"))
    procs = {
        dist: (
            version,
            subprocess.Popen([str(bindir / script), "--version"], stdout=subprocess.PIPE, text=True),
        )
        for dist, version, _, script in MEMBERS
    }
    for dist, (version, proc) in procs.items():
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, dist
        lines = [line.split() for line in out.splitlines()]
        # `gyre --version` lists every component; the others print "<name> <version>"
        assert [dist, version] in lines, (dist, out)


def test_every_member_admits_the_versions_of_the_members_it_depends_on() -> None:
    """A member's requirement on another member (plain or in an extra) admits that member's version here:
    installed from an index, the packages of one commit install together, and none pulls an older one that
    lacks what it calls."""
    from packaging.requirements import Requirement

    versions = {dist: version for dist, version, _, _ in MEMBERS}
    wrong = []
    for pattern in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["uv"]["workspace"]["members"]:
        for folder in sorted(glob.glob(str(ROOT / pattern))):
            project = tomllib.loads((Path(folder) / "pyproject.toml").read_text())["project"]
            reqs = list(project.get("dependencies", []))
            reqs += [r for extra in project.get("optional-dependencies", {}).values() for r in extra]
            for text in reqs:
                req = Requirement(text)
                if req.name in versions and not req.specifier.contains(versions[req.name]):
                    wrong.append(f"{project['name']}: {text} (workspace has {versions[req.name]})")
    assert wrong == []


def test_the_readme_names_every_member_at_its_version() -> None:
    """The root README's table of packages gives each member's version as its pyproject declares it."""
    readme = (ROOT / "README.md").read_text()
    stale = [f"{dist} {version}" for dist, version, _, _ in MEMBERS if f"| {dist} {version} |" not in readme]
    assert stale == []
