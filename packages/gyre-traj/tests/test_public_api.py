"""The package as a library: every name in `gyre_traj.__all__` resolves, `import gyre_traj` (and every
name but the loss's) never imports torch, and the README's Python blocks run exactly as written, so the
README cannot drift from the code."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import gyre_traj
import pytest

PACKAGE = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"


def _python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (PACKAGE / "README.md").read_text(), re.S | re.M)


def test_every_public_name_resolves() -> None:
    for name in gyre_traj.__all__:
        assert getattr(gyre_traj, name) is not None, name
    assert set(gyre_traj.__all__) <= set(dir(gyre_traj))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        gyre_traj.nope  # type: ignore[attr-defined]  # noqa: B018


def test_import_never_imports_torch() -> None:
    """In a fresh interpreter: importing the package and touching every name outside the loss leaves
    torch unimported; the first loss name imports it."""
    code = (
        "import sys, gyre_traj as gt\n"
        "names = [n for n in gt.__all__ if n not in gt._TORCH_NAMES]\n"
        "[getattr(gt, n) for n in names]\n"
        "assert 'torch' not in sys.modules, 'torch imported by gyre_traj'\n"
        "gt.policy_loss\n"
        "assert 'torch' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_readme_has_the_blocks_this_test_runs() -> None:
    blocks = _python_blocks()
    assert len(blocks) == 2
    assert "gt.target_logprobs(model, batch)" in blocks[0] and "gt.policy_loss(" in blocks[0]


def test_readme_records_to_loss_runs_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    exec(compile(_python_blocks()[0], "README.md", "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert re.fullmatch(r"2 executions, 8 loss tokens, metrics \{'loss': .*\}\n", out), out
    assert (tmp_path / "traces.jsonl").is_file()


def test_readme_reading_other_systems_traces_runs_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.copy(FIXTURES / "slime" / "samples.jsonl", tmp_path / "samples.jsonl")
    shutil.copytree(FIXTURES / "verl" / "with_ids", tmp_path / "rollout_data")
    shutil.copy(FIXTURES / "messages" / "vllm_chat.jsonl", tmp_path / "calls.jsonl")
    monkeypatch.chdir(tmp_path)
    exec(compile(_python_blocks()[1], "README.md", "exec"), {"__name__": "readme"})
    assert capsys.readouterr().out == (
        "slime 6 executions, 6 scored\nverl 6 executions, 6 scored\ncalls 2 executions, 2 scored\n"
    )
