"""The run's scalar writer: a step's `steps.jsonl` line and summary flattened to named numbers, written to
TensorBoard event files and to a W&B offline run (WANDB_MODE=offline, its files in a temporary directory),
read back from the files; a W&B project without wandb installed is an error naming the extra."""

from __future__ import annotations

import builtins
from pathlib import Path
from typing import Any

import pytest
from gyre.config.runconfig import ConfigError, LogSection, config_from_dict
from gyre.measure.scalars import ScalarLog, WandbMissing, step_scalars

from .logfiles import tb_scalars, wandb_history

LINE = {
    "step": 3, "version": 3, "queue_position": 3, "microbatches": 2, "by_replica": {"core": 1, "cell-1": 1},
    "loss": -0.25, "grad_norm": 1.5, "skipped": False, "engine_push": None,
    "staleness": {"max": 1, "mean": 0.5, "tokens_by_lag": {"0": 10, "1": 10}},
    "metrics": {"approx_kl": 0.01, "entropy": 2.0},
    "mismatch": {"tokens": 10, "abs_mean": 0.002, "abs_max": 0.01, "k3": 1e-5},
    "t_start": 100.0, "t_end": 104.0,
}  # fmt: skip
SUMMARY = {"mean_score": 0.75, "tokens": 400, "timed_out": 0, "closed_at": 103.0, "trained_executions": ["a"]}


def test_step_scalars_flatten_every_number_of_the_line_and_summary() -> None:
    s = step_scalars(LINE, SUMMARY, prev_end=102.0)
    assert s["train/mismatch/abs_mean"] == 0.002 and s["train/mismatch/k3"] == 1e-5
    assert s["train/loss"] == -0.25 and s["train/metrics/entropy"] == 2.0
    assert s["train/staleness/tokens_by_lag/1"] == 10 and s["train/by_replica/cell-1"] == 1
    assert s["rollout/mean_score"] == 0.75 and s["train/skipped"] == 0.0
    assert s["train/tokens_per_s"] == 400 / 2.0  # since the previous step ended
    assert step_scalars(LINE, SUMMARY, None)["train/tokens_per_s"] == 400 / 4.0  # the first: its own start
    assert not {"train/t_end", "train/step", "rollout/closed_at"} & set(s)  # instants are not scalars


def test_scalars_reach_tensorboard_and_a_wandb_offline_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "run"
    out.mkdir()
    log = ScalarLog(out, LogSection(wandb_project="gyre-test"), suffix=".run", config={"train": {"lr": 0.1}})
    log.write(1, step_scalars(LINE, SUMMARY, None))
    log.write(2, {"train/loss": 0.5})
    log.close()
    tb = tb_scalars(out / "tb")
    assert tb["train/mismatch/abs_mean"] == {1: pytest.approx(0.002)} and tb["train/loss"] == {
        1: -0.25,
        2: 0.5,
    }
    (run_file,) = out.glob("wandb/offline-run-*/run-*.wandb")
    rows = wandb_history(run_file)
    assert [r["_step"] for r in rows] == [1, 2]
    assert rows[0]["train/mismatch/abs_mean"] == 0.002 and rows[0]["rollout/mean_score"] == 0.75
    assert rows[1]["train/loss"] == 0.5


def test_a_wandb_project_without_wandb_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = builtins.__import__

    def no_wandb(name: str, *a: Any, **kw: Any) -> Any:
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(WandbMissing, match=r"gyre\[wandb\]"):
        ScalarLog(tmp_path, LogSection(wandb_project="p"))
    ScalarLog(tmp_path, LogSection(wandb_project="p", wandb_mode="disabled")).close()  # nothing to import


def test_log_and_train_keys_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"\[log\] wandb_mode must be offline, online or disabled"):
        config_from_dict({"log": {"wandb_mode": "cloud"}})
    with pytest.raises(ConfigError, match=r"\[train\] tis_cap must be >= 0"):
        config_from_dict({"train": {"tis_cap": -1.0}})
    with pytest.raises(ConfigError, match="wandb_projct"):
        config_from_dict({"log": {"wandb_projct": "x"}})
    cfg = config_from_dict({"train": {"tis_cap": 2.0, "mismatch_warn": 0.05}, "log": {"wandb_project": "p"}})
    assert (cfg.train.tis_cap, cfg.train.mismatch_warn, cfg.log.wandb_mode) == (2.0, 0.05, "offline")
