"""`gyre-train mismatch`: gyre-engine and the trainer load the same model directory and agree on every
sampled token's logprob (float32, <= 1e-4), for each family with non-default forward fields; a Qwen3
directory with rope_theta 1e6 and rms_norm_eps 1e-5 is the case that once differed by up to 3.9."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("gyre_engine.server")
sys.path.insert(0, str(Path(__file__).parent))  # shared helpers (tests run with --import-mode=importlib)
import family_dirs  # noqa: E402
from gyre_engine.server.model_factory import create_model  # noqa: E402
from gyre_train.cli import main  # noqa: E402

TOL = 1e-4


def _mismatch(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["mismatch", *argv]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_qwen3_rope_theta_and_rms_norm_eps_reach_the_trainer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = create_model(tmp_path / "m", "tiny", seed=0, overrides={"rope_theta": 1e6, "rms_norm_eps": 1e-5})
    rep = _mismatch(capsys, str(d))
    assert rep["family"] == "qwen3" and rep["dtype"] == "float32" and rep["tokens"] > 24
    assert rep["max_abs_logprob_diff"] <= TOL, rep
