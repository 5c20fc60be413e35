"""Megatron-core backend on a CUDA GPU (skipped without one; run on an H200):
on a model with Qwen3-0.6B-shaped layers, tree-packed logprobs with RoPE from tree position ids equal
each path run alone and the same weights in transformers; the tree-packed gradient equals the
path-expanded one; a core step trains it on the GPU."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gyre_train.data import synthetic_minibatch
from gyre_train.model import ModelConfig, build_model
from gyre_traj.loss import LossConfig, TorchBatch, policy_loss, target_logprobs

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning", "ignore::FutureWarning"),
]
M = pytest.importorskip("gyre_train.megatron")
sys.path.insert(
    0, str(Path(__file__).parent)
)  # the shared reference (tests run with --import-mode=importlib)
import megatron_checks  # noqa: E402

# Qwen3-0.6B's layer shape (1024 wide, 16 x 128 query heads, 8 key/value heads, 3072 MLP) with 4 layers
# and a smaller vocabulary, float32 so the comparisons are tight.
MC = ModelConfig(
    backend="megatron",
    vocab_size=32768,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
)


@pytest.fixture(autouse=True)
def _exact_matmuls() -> object:
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_tree_packed_on_cuda_equals_paths_and_transformers() -> None:
    batch = synthetic_minibatch(2, seed=4)[0]
    gpt = build_model(MC, device="cuda")
    tb = TorchBatch.from_packed(batch, device="cuda")
    with torch.no_grad():
        packed = M.tree_target_logprobs(gpt, tb)
        ref = megatron_checks.path_logprobs(gpt, batch, "cuda")
        diff_paths = float((packed - ref).abs().max())
        hf = build_model(dataclasses.replace(MC, backend="transformers"), device="cuda")
        sd = M.hf_state_dict(gpt, MC)
        for k, p in hf.named_parameters():
            p.copy_(torch.as_tensor(sd[k], device="cuda"))
        diff_hf = float((target_logprobs(hf, tb) - packed).abs().max())
    print(f"megatron on cuda: tree vs paths {diff_paths:.2e}, vs transformers {diff_hf:.2e}")
    assert diff_paths < 1e-4 and diff_hf < 1e-4


def test_tree_packed_gradient_equals_path_expanded_on_cuda() -> None:
    cfg = LossConfig(mode="tis")
    grads = []
    for mode in ("tree", "paths"):
        gpt = build_model(MC, device="cuda")
        batches = synthetic_minibatch(2, seed=6, mode=mode, token_budget=4096)
        for b in batches:
            tb = TorchBatch.from_packed(b, device="cuda")
            loss, _ = policy_loss(M.tree_target_logprobs(gpt, tb), tb, cfg)
            loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in gpt.parameters()]))
    scale = float(grads[0].abs().max())
    err = float((grads[0] - grads[1]).abs().max())
    print(f"megatron on cuda: gradient tree vs paths max |diff| {err:.2e} (max |grad| {scale:.2e})")
    assert scale > 0 and err <= 1e-3 * scale


def test_core_trains_megatron_on_cuda() -> None:
    from gyre_train.core import Core, CoreConfig

    mbs = synthetic_minibatch(3, seed=8)
    core = Core(build_model(MC, device="cuda"), MC, CoreConfig(token_budget=512, loss=LossConfig(mode="tis")))
    try:
        before = {n: p.detach().clone() for n, p in core.model.named_parameters()}
        r = core.train_step(mbs)
        assert np.isfinite(r.grad_norm) and r.grad_norm > 0
        moved = sum(int(not torch.equal(p.detach(), before[n])) for n, p in core.model.named_parameters())
        assert moved == len(before)
        assert next(core.model.parameters()).device.type == "cuda"
    finally:
        core.close()
