"""The `gyre-xfer` command: `doctor` moves real bytes over Mooncake on loopback and says which wheel it uses."""

from __future__ import annotations

import importlib.metadata
import json
import tomllib
from pathlib import Path

import gyre_xfer
import pytest
from gyre_xfer.cli import main


@pytest.mark.mooncake
def test_doctor_reports_a_working_mooncake(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["doctor"])
    assert exit_info.value.code == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["mooncake"] == "ok"
    assert report["mooncake_wheel"] == "mooncake-transfer-engine-non-cuda"
    assert all(e.startswith("127.0.0.1:") for e in report["endpoints"])


PYPROJECT_VERSION = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())[
    "project"
]["version"]


def test_version_is_the_one_in_pyproject(capsys: pytest.CaptureFixture[str]) -> None:
    assert gyre_xfer.__version__ == PYPROJECT_VERSION
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"gyre-xfer {PYPROJECT_VERSION}"


def test_version_of_a_source_tree_that_is_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert gyre_xfer._version() == PYPROJECT_VERSION


def test_token_prints_a_new_random_token(capsys: pytest.CaptureFixture[str]) -> None:
    main(["token"])
    main(["token"])
    first, second = capsys.readouterr().out.split()
    assert len(first) == 43 and first != second
