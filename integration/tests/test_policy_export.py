"""The run's policy export says what is missing instead of failing a finished run (gyre-train's export
error, e.g. no checkpoint), and reads the checkpoint's version only when it is whole (the export itself
is checked on the tiny run, test_run_e2e.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gyre.system.policy import NotExported, checkpoint_version, export


def test_no_checkpoint_is_said_and_its_version_is_none(tmp_path: Path) -> None:
    assert checkpoint_version(tmp_path / "checkpoint") is None
    with pytest.raises(NotExported, match="is not a gyre-train checkpoint"):
        export(tmp_path / "checkpoint", tmp_path / "policy", tmp_path)
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "state.json").write_text(json.dumps({"version": 3}))
    assert checkpoint_version(tmp_path / "checkpoint") == 3
    (tmp_path / "checkpoint" / "state.json").write_text('{"vers')  # being written
    assert checkpoint_version(tmp_path / "checkpoint") is None
    assert not (tmp_path / "policy").exists()
