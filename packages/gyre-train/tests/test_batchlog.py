"""Kept micro-batches (`CoreConfig.keep_batches`, `batchlog.py`): a core writes each applied step's
micro-batches, and reading them back gives the same arrays, so a benchmark can train them again alone;
a truncated or foreign file is a MicroBatchError."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gyre_train import batchlog
from gyre_train.core import Core, CoreConfig
from gyre_train.data import synthetic_minibatch
from gyre_train.model import ModelConfig, build_model
from gyre_train.wire import MICROBATCH_FIELDS, MicroBatchError

MC = ModelConfig()


def _same(a: object, b: object) -> None:
    for k in MICROBATCH_FIELDS:
        x, y = getattr(a, k), getattr(b, k)
        assert x.dtype == y.dtype and np.array_equal(x, y), k


def test_a_core_keeps_each_applied_steps_microbatches(tmp_path: Path) -> None:
    core = Core(build_model(MC), MC, CoreConfig(token_budget=512, keep_batches=str(tmp_path / "b")))
    try:
        steps = [synthetic_minibatch(3, seed=s, token_budget=512) for s in (1, 2)]
        for mbs in steps:
            core.train_step(mbs)
    finally:
        core.close()
    got = batchlog.read_steps(tmp_path / "b")
    assert [h.seq for h, _ in got] == [0, 1]
    for (head, mbs), want in zip(got, steps, strict=True):
        assert head.executions == 1 and len(mbs) == len(want)
        for a, b in zip(mbs, want, strict=True):
            _same(a, b)


def test_a_damaged_file_is_refused(tmp_path: Path) -> None:
    mbs = synthetic_minibatch(2, seed=3, token_budget=512)
    p = batchlog.write_step(tmp_path, 7, mbs, 2)
    head, back = batchlog.read_step(p)
    assert (head.seq, head.executions, len(back)) == (7, 2, len(mbs))
    data = p.read_bytes()
    for bad in (data[:-5], data + b"x", b"nonsense" + data, data[: len(batchlog.MAGIC) + 6]):
        p.write_bytes(bad)
        with pytest.raises(MicroBatchError):
            batchlog.read_step(p)
