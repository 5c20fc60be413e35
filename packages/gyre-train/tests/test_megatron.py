"""Megatron-core backend on the CPU (gloo, local layer spec): tree-packed batches with RoPE taken from
tree position ids give each path's logprobs run alone (Megatron's stock forward does not), the weights
convert to transformers with identical logits, and the core trains it with a satellite exactly."""

from __future__ import annotations

import dataclasses
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from gyre_train.data import synthetic_minibatch
from gyre_train.model import ModelConfig, build_model
from gyre_traj.loss import LossConfig, TorchBatch, target_logprobs

M = pytest.importorskip("gyre_train.megatron")
sys.path.insert(
    0, str(Path(__file__).parent)
)  # the shared reference (tests run with --import-mode=importlib)
import megatron_checks  # noqa: E402

# megatron-core 0.19 warns on every forward (deprecated GPTModel, implicit tp_group); not ours to fix.
pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::UserWarning", "ignore::FutureWarning"
)

MC = ModelConfig(backend="megatron")
BATCH = synthetic_minibatch(2, seed=4)[0]


def test_tree_packed_equals_each_path_alone_and_matches_transformers() -> None:
    gpt = build_model(MC)
    tb = TorchBatch.from_packed(BATCH)
    with torch.no_grad():
        packed = M.tree_target_logprobs(gpt, tb)
        ref = megatron_checks.path_logprobs(gpt, BATCH)
        torch.testing.assert_close(packed, ref, atol=2e-5, rtol=0)
        # Megatron's own forward on the packed batch takes RoPE from the sequence index: wrong for trees.
        n = BATCH.num_tokens
        allowed = torch.as_tensor(BATCH.dense_mask())
        stock = gpt(
            input_ids=tb.input_ids[None],
            position_ids=tb.position_ids[None],
            attention_mask=~allowed[None, None],
        )
        stock_lp = torch.log_softmax(stock[0, tb.target_pos].float(), -1).gather(1, tb.target_ids[:, None])[
            :, 0
        ]
        assert float((stock_lp - ref).abs().max()) > 1e-3
        assert n > int(BATCH.position_ids.max()) + 1  # the batch really is branched
        # The same weights in the transformers layout give the same logprobs.
        hf = build_model(dataclasses.replace(MC, backend="transformers"))
        sd = M.hf_state_dict(gpt, MC)
        assert set(sd) == {k for k, _ in hf.named_parameters()}
        for k, p in hf.named_parameters():
            p.copy_(torch.as_tensor(sd[k]))
        torch.testing.assert_close(target_logprobs(hf, tb), packed, atol=1e-5, rtol=0)


def test_core_trains_megatron_with_a_satellite_exactly() -> None:
    from gyre_train.core import Core, CoreConfig
    from gyre_train.satellite import Satellite, SatelliteConfig

    mbs = synthetic_minibatch(3, seed=8)
    alone = Core(build_model(MC), MC, CoreConfig(token_budget=512, loss=LossConfig(mode="tis")))
    try:
        alone.train_step(mbs)
        want = {n: p.detach().clone() for n, p in alone.model.named_parameters()}
    finally:
        alone.close()
    core = Core(build_model(MC), MC, CoreConfig(token_budget=512, loss=LossConfig(mode="tis")))
    sat = Satellite(SatelliteConfig(core.address, "meg-sat"))
    th = threading.Thread(target=sat.run, daemon=True)
    th.start()
    try:
        core.admit("meg-sat")

        def hold(k: int) -> None:
            if k == 1:
                deadline = threading.Event()
                for _ in range(6000):
                    if core.replicas().get("meg-sat", {}).get("claims", 0):
                        break
                    deadline.wait(0.01)

        r = core.train_step(mbs, on_progress=hold)
        assert r.by_replica.get("meg-sat", 0) >= 1
        for n, p in core.model.named_parameters():
            torch.testing.assert_close(p.detach(), want[n], atol=0, rtol=0, msg=n)
        assert np.isfinite(r.grad_norm) and r.grad_norm > 0
    finally:
        core.close()
        th.join(timeout=30)
        sat.close()
