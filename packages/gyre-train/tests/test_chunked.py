"""A tree larger than a micro-batch, trained chunk by chunk with shared keys and values computed once,
gives the gradient of the whole tree as one micro-batch; the chunk plan covers every token once and
gathers exactly each chunk's ancestors."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from gyre_train.chunked import chunked_loss_backward, plan
from gyre_train.data import synthetic_minibatch
from gyre_train.model import ModelConfig, build_model
from gyre_traj.loss import LossConfig, TorchBatch, policy_loss, target_logprobs
from gyre_traj.pack import PackedBatch
from hypothesis import given, settings
from hypothesis import strategies as st

BIG = synthetic_minibatch(2, seed=5, token_budget=100_000)[0]


@settings(max_examples=60, deadline=None)
@given(budget=st.integers(1, 1400))
def test_plan_covers_each_token_once_and_gathers_ancestors(budget: int) -> None:
    chunks = plan(BIG, budget)
    assert chunks[0].lo == 0 and chunks[-1].hi == BIG.num_tokens
    for a, b in itertools.pairwise(chunks):
        assert a.hi == b.lo
    par = BIG.parent
    for c in chunks:
        assert 0 < c.hi - c.lo <= budget
        want: set[int] = set()
        for i in range(c.lo, c.hi):
            p = int(par[i])
            while p >= 0 and p < c.lo and p not in want:
                want.add(p)
                p = int(par[p])
        assert set(c.ext.tolist()) == want
    assert sorted(np.concatenate([c.targets for c in chunks]).tolist()) == list(range(BIG.num_loss_tokens))


def _one_microbatch_grads(
    model: torch.nn.Module, batch: PackedBatch, cfg: LossConfig
) -> tuple[float, dict[str, torch.Tensor], float]:
    """The loss, per-parameter gradients and largest gradient magnitude of `batch` as one micro-batch."""
    tb = TorchBatch.from_packed(batch)
    model.zero_grad()
    loss, _ = policy_loss(target_logprobs(model, tb), tb, cfg)
    loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    scale = max(float(g.abs().max()) for g in ref.values())
    assert scale > 0
    return float(loss.detach()), ref, scale


def _assert_grads(model: torch.nn.Module, ref: dict[str, torch.Tensor], scale: float) -> None:
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], atol=1e-6 * scale, rtol=1e-4, msg=n)


@pytest.mark.parametrize("mode", ["ppo", "tis"])
def test_chunked_gradient_equals_one_microbatch(mode: str) -> None:
    model = build_model(ModelConfig())
    cfg = LossConfig(mode=mode)  # type: ignore[arg-type]
    tb = TorchBatch.from_packed(BIG)
    # Behaviour logprobs near the current policy so that PPO ratios fall on both sides of the clip.
    with torch.no_grad():
        old = target_logprobs(model, tb) + 0.3 * torch.sin(
            torch.arange(BIG.num_loss_tokens, dtype=torch.float32)
        )
    big = type(BIG)(**{**BIG.__dict__, "old_logprobs": old.numpy().astype(np.float32)})
    loss, ref, scale = _one_microbatch_grads(model, big, cfg)
    for budget, loss_slice in ((64, 2048), (300, 7)):  # the loss in one slice per chunk / in many
        model.zero_grad()
        m = chunked_loss_backward(model, big, budget, cfg, loss_slice=loss_slice)
        assert m["shared_chunks"] >= 1
        with_ancestors = sum(1 for c in plan(big, budget) if c.ext.shape[0])
        assert m["joined_in_place"] + m["joined_gathered"] == with_ancestors
        assert abs(m["loss"] - loss) <= 1e-5 * max(1.0, abs(loss))
        _assert_grads(model, ref, scale)


@pytest.mark.parametrize("branches", [0, 3])
def test_trunk_and_branches_join_in_place_with_the_same_gradient(branches: int) -> None:
    """A long trunk (and branches off its end): every chunk reads its ancestors' kept keys/values as a
    view of the kept buffer (no gathered copy), and the gradient is that of one micro-batch."""
    from gyre_train.bench.run import Fan, fan_tree, packs

    tree = fan_tree(Fan(1280, branches, 160), seed=3)  # trunk = 5 chunks of 256
    b = packs(tree, max(branches, 1))[0][0]
    model = build_model(ModelConfig())
    cfg = LossConfig(mode="tis")
    _, ref, scale = _one_microbatch_grads(model, b, cfg)
    model.zero_grad()
    m = chunked_loss_backward(model, b, 256, cfg)
    assert m["chunks"] >= 5 and m["joined_gathered"] == 0
    assert m["joined_in_place"] == m["chunks"] - 1
    _assert_grads(model, ref, scale)


@pytest.mark.slow
def test_flex_chunk_mask_matches_dense_forward() -> None:
    """The GPU path's FlexAttention BlockMask over gathered ancestor keys/values equals the dense mask
    (forward only: FlexAttention has no backward on the CPU)."""
    from gyre_train.chunked import ChunkCache, Kept, _forward

    mc = ModelConfig()
    dense, flex = build_model(mc, "dense"), build_model(mc, "flex")
    flex.load_state_dict(dense.state_dict())
    tb = TorchBatch.from_packed(BIG)
    c = next(c for c in plan(BIG, 300) if c.ext.shape[0] and c.hi - c.lo > 100)
    g = torch.Generator().manual_seed(0)
    shape = (1, mc.num_key_value_heads, int(c.ext.shape[0]), mc.head_dim)
    past = [
        (torch.randn(shape, generator=g), torch.randn(shape, generator=g))
        for _ in range(mc.num_hidden_layers)
    ]
    ext = torch.as_tensor(c.ext)

    def run(model: torch.nn.Module, attention: str) -> torch.Tensor:
        kept = Kept(c.lo, 300)
        for li, (k, v) in enumerate(past):
            kb, vb = kept.buffers(li, k)
            kb[:, :, ext], vb[:, :, ext] = k, v
        with torch.no_grad():
            return _forward(model, tb, c, ChunkCache(kept, c, False, tb.input_ids.device), attention)  # type: ignore[arg-type]

    torch.testing.assert_close(run(flex, "flex"), run(dense, "dense"), atol=1e-5, rtol=1e-5)


def test_huge_tree_bench_case_runs_and_scales_sampled_paths() -> None:
    """The bench's huge-tree case on the CPU: both sides chunked under one budget, sampled path times
    scaled to all paths, kept memory as the formula says."""
    from gyre_train.bench.run import Fan, huge

    mc = ModelConfig()
    model = build_model(mc)
    r = huge(model, mc, Fan(512, 3, 64), 128, "dense", "cpu", path_sample=1, repeats=2)
    assert r["paths"] == 3 and r["paths_timed"] == 1 and len(r["tree_rounds_s"]) == 2
    assert r["paths_chunked_s"] == pytest.approx(r["per_path_s"][0] * 3)
    assert r["ideal_ratio"] == pytest.approx(3 * (512 + 64) / (512 + 3 * 64))
    per = mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * 2
    assert r["kept_tree"] == {
        "shared_tokens": 512,
        "kv_bytes": per * (512 + 128) * 4,
        "accumulator_bytes": per * 512 * 4,
    }
    assert r["chunked_speedup"] == pytest.approx(r["paths_chunked_s"] / r["chunked_s"])


def test_a_flex_model_raises_the_recompile_limit_and_fails_rather_than_run_unfused() -> None:
    """Past torch.compile's per-function graph limit FlexAttention would run unfused (every score
    materialised: minutes a layer for a long chunk); a flex model raises the limit and makes reaching
    it an error. The dense model leaves torch's settings alone."""
    import torch._dynamo.config as dynamo
    from gyre_train.model import FLEX_RECOMPILE_LIMIT

    was = (dynamo.recompile_limit, dynamo.accumulated_recompile_limit, dynamo.fail_on_recompile_limit_hit)
    try:
        dynamo.recompile_limit, dynamo.fail_on_recompile_limit_hit = 8, False
        build_model(ModelConfig(), "dense")
        assert (dynamo.recompile_limit, dynamo.fail_on_recompile_limit_hit) == (8, False)
        build_model(ModelConfig(), "flex")
        assert dynamo.recompile_limit == FLEX_RECOMPILE_LIMIT and dynamo.fail_on_recompile_limit_hit
        assert dynamo.accumulated_recompile_limit >= 4 * FLEX_RECOMPILE_LIMIT
        dynamo.recompile_limit = 1000  # never lowered
        build_model(ModelConfig(), "flex")
        assert dynamo.recompile_limit == 1000
    finally:
        dynamo.recompile_limit, dynamo.accumulated_recompile_limit, dynamo.fail_on_recompile_limit_hit = was


def test_a_dense_chunk_mask_is_additive_in_the_model_dtype_with_rows_16_apart() -> None:
    """The dense chunk mask is built once per chunk for all layers as an additive mask of the model's
    dtype (SDPA would turn a boolean one into a new tensor at every layer, each kept for backward), its
    rows a multiple of 16 elements apart (the memory-efficient kernel's alignment, else it pads a copy),
    and sees what the boolean ancestor mask sees."""
    from gyre_train.chunked import chunk_mask

    tb = TorchBatch.from_packed(BIG)
    c = next(c for c in plan(BIG, 300) if c.ext.shape[0] and (c.ext.shape[0] + c.hi - c.lo) % 16)
    kidx = torch.cat([torch.as_tensor(c.ext, dtype=torch.long), torch.arange(c.lo, c.hi)])
    m = chunk_mask(tb, c, kidx, "dense", torch.bfloat16)
    n = int(kidx.shape[0])
    assert m.dtype == torch.bfloat16 and m.shape == (1, 1, c.hi - c.lo, n)
    assert all(st % 16 == 0 for st in m.stride()[:-1]) and m.stride(-1) == 1
    q = torch.arange(c.lo, c.hi)
    seen = (kidx[None, :] <= q[:, None]) & (q[:, None] <= tb.last_desc[kidx][None, :])
    assert torch.equal(m[0, 0] == 0, seen) and bool(torch.isneginf(m[0, 0][~seen]).all())
