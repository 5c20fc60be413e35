"""Each applied step reports the train-inference mismatch of its on-policy tokens: the behaviour logprobs a
micro-batch carries against the trainer's recomputation at the step's version, summed exactly over the
micro-batches the core and a satellite computed; a step above `CoreConfig.mismatch_warn` logs a warning."""

from __future__ import annotations

import dataclasses
import logging
import threading

import numpy as np
import pytest
import torch
from gyre_base.testing import until
from gyre_train.core import Core, CoreConfig
from gyre_train.data import synthetic_minibatch
from gyre_train.model import ModelConfig, build_model, target_logprobs_of
from gyre_train.satellite import Satellite, SatelliteConfig
from gyre_traj.pack import PackedBatch

MC = ModelConfig()


def _with_behaviour(core: Core, mbs: list[PackedBatch], version: int, seed: int) -> list[PackedBatch]:
    """Every other loss token sampled at `version` (the rest at 0), the engine's logprobs the trainer's
    now off by noise (as an engine in another dtype would record them)."""
    rng = np.random.default_rng(seed)
    out = []
    for b in mbs:
        n = b.num_loss_tokens
        versions = np.where(np.arange(n) % 2 == 0, version, 0).astype(np.int32)
        noise = rng.normal(0.0, 0.05, size=n)
        old = np.minimum(target_logprobs_of(core.model, b).double().numpy() + noise, 0.0).astype(np.float32)
        out.append(dataclasses.replace(b, versions=versions, old_logprobs=old))
    return out


def _expected(core: Core, mbs: list[PackedBatch], version: int) -> tuple[int, float, float, float]:
    """(tokens, mean |r|, max |r|, mean exp(r) - 1 - r) over the tokens sampled at `version`, with r the
    trainer's logprob (the core's model now, before the step) minus the behaviour's."""
    rs = []
    for b in mbs:
        lp = target_logprobs_of(core.model, b).double()
        r = lp - torch.as_tensor(b.old_logprobs, dtype=torch.float64)
        rs.append(r[torch.as_tensor(b.versions) == version])
    r = torch.cat(rs)
    return r.numel(), float(r.abs().mean()), float(r.abs().max()), float((torch.exp(r) - 1 - r).mean())


def test_mismatch_is_summed_over_the_core_and_a_satellite_on_policy_tokens_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    core = Core(build_model(MC), MC, CoreConfig(token_budget=512, mismatch_warn=1e-6))
    sat = Satellite(SatelliteConfig(core.address, "sat-m"))
    th = threading.Thread(target=sat.run, daemon=True)
    th.start()
    try:
        core.train_step(synthetic_minibatch(4, seed=3, token_budget=512))  # now at version 1
        mbs = _with_behaviour(core, synthetic_minibatch(4, seed=4, token_budget=512), 1, seed=5)
        assert len(mbs) >= 3
        tokens, abs_mean, abs_max, k3 = _expected(core, mbs, 1)

        def join_after_first(k: int) -> None:
            if k == 1:
                core.admit("sat-m")
                until(lambda: core.replicas()["sat-m"]["claims"] > 0, "sat-m to claim", 60.0)

        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="gyre_train.core"):
            rep = core.train_step(mbs, on_progress=join_after_first)
        assert rep.by_replica.get("core", 0) > 0 and rep.by_replica.get("sat-m", 0) > 0
        m = rep.mismatch
        assert m.tokens == tokens == sum((b.versions == 1).sum() for b in mbs)  # the stale half left out
        assert m.abs_mean == pytest.approx(abs_mean, rel=1e-4)
        assert m.abs_max == pytest.approx(abs_max, rel=1e-4)
        assert m.k3 == pytest.approx(k3, rel=1e-3)
        assert 0.02 < m.abs_mean < 0.08 and m.k3 > 0
        warned = [r.getMessage() for r in caplog.records if "train-inference mismatch" in r.getMessage()]
        assert len(warned) == 1 and f"step {rep.step}:" in warned[0]
    finally:
        core.close()
        th.join(timeout=30)
        sat.close()


def test_behaviour_equal_to_the_trainer_has_no_mismatch_and_no_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    core = Core(build_model(MC), MC, CoreConfig(token_budget=512))
    try:
        mbs = synthetic_minibatch(4, seed=6, token_budget=512)
        same = [
            dataclasses.replace(b, old_logprobs=target_logprobs_of(core.model, b).numpy().astype(np.float32))
            for b in mbs
        ]
        with caplog.at_level(logging.WARNING, logger="gyre_train.core"):
            rep = core.train_step(same)
        assert rep.mismatch.tokens == sum(b.num_loss_tokens for b in mbs)  # all sampled at version 0
        assert rep.mismatch.abs_max < 1e-5 and abs(rep.mismatch.k3) < 1e-9
        assert not [r for r in caplog.records if "mismatch" in r.getMessage()]
        stale = core.train_step(_with_behaviour(core, mbs, 0, seed=7))  # at version 1, every token older
        assert stale.mismatch.tokens == 0 and stale.mismatch.abs_mean == 0.0
    finally:
        core.close()


def test_a_chunked_microbatch_reports_the_mismatch_of_the_whole() -> None:
    big = synthetic_minibatch(4, seed=6, token_budget=1500)  # micro-batches several times the chunk budget
    reports = []
    for chunk_budget, memory in ((0, "auto"), (200, "kept"), (200, "layers-host")):
        cfg = CoreConfig(token_budget=1500, chunk_budget=chunk_budget, chunk_memory=memory)  # type: ignore[arg-type]
        core = Core(build_model(MC), MC, cfg)
        try:
            reports.append(core.train_step(_with_behaviour(core, big, 0, seed=8)))
        finally:
            core.close()
    plain = reports[0].mismatch
    assert max(b.num_tokens for b in big) > 200 and plain.tokens == sum(b.num_loss_tokens for b in big)
    for r in reports[1:]:  # both memory methods of chunked training (keys/values kept, layer by layer)
        chunked = r.mismatch
        assert chunked.tokens == plain.tokens
        assert chunked.abs_mean == pytest.approx(plain.abs_mean, rel=1e-4)
        assert chunked.abs_max == pytest.approx(plain.abs_max, rel=1e-4)
        assert chunked.k3 == pytest.approx(plain.k3, rel=1e-3)
