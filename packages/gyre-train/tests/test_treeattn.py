"""Tree attention (runs of a tree-packed forward, each causal over its ancestors' keys and its own, no
mask): every query sees exactly its ancestors, and a micro-batch trained with it, whole or in chunks over
kept keys, has the gradient it has under the dense ancestor mask."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gyre_train.chunked import chunk_mask, chunked_loss_backward, plan
from gyre_train.data import synthetic_minibatch
from gyre_train.model import Layout, ModelConfig, attention_implementation, build_model, micro_gradient
from gyre_train.treeattn import TreeRuns, plan_runs, whole_runs
from gyre_traj.loss import LossConfig, TorchBatch
from hypothesis import given, settings
from hypothesis import strategies as st

BIG = synthetic_minibatch(2, seed=5, token_budget=100_000)[0]


def _seen(runs: TreeRuns, rows: int) -> np.ndarray:
    """The [rows, keys] boolean mask the runs attend with: row i of a run sees its columns up to its own
    token (causal aligned to the bottom right)."""
    out = np.zeros((rows, runs.keys), dtype=bool)
    for r in runs.runs:
        cols = np.arange(runs.keys)[r.cols] if isinstance(r.cols, slice) else r.cols
        own0 = len(cols) - (r.hi - r.lo)
        for i in range(r.lo, r.hi):
            out[i, cols[: own0 + i - r.lo + 1]] = True
    return out


@settings(max_examples=40, deadline=None)
@given(budget=st.integers(16, 1400))
def test_every_query_sees_exactly_its_ancestors(budget: int) -> None:
    tb = TorchBatch.from_packed(BIG)
    for c in plan(BIG, budget):
        kidx = torch.cat([torch.as_tensor(c.ext, dtype=torch.long), torch.arange(c.lo, c.hi)])
        runs = chunk_mask(tb, c, kidx, "tree")
        assert isinstance(runs, TreeRuns) and runs.runs[0].lo == 0 and runs.runs[-1].hi == c.hi - c.lo
        assert all(a.hi == b.lo for a, b in zip(runs.runs, runs.runs[1:], strict=False))
        q = torch.arange(c.lo, c.hi)
        want = (kidx[None, :] <= q[:, None]) & (q[:, None] <= tb.last_desc[kidx][None, :])
        assert np.array_equal(_seen(runs, c.hi - c.lo), want.numpy())


def test_a_trunk_reads_its_keys_as_one_view_and_branches_off_it_gather() -> None:
    # 0-9 a trunk; 10-14 a branch off token 7; 15-19 a branch off token 4 (DFS preorder)
    last_desc = np.array([19] * 5 + [14] * 3 + [9] * 2 + [14] * 5 + [19] * 5)
    runs = whole_runs(last_desc)
    assert [(r.lo, r.hi) for r in runs.runs] == [(0, 10), (10, 15), (15, 20)]
    assert runs.runs[0].cols == slice(0, 10) and runs.gathers() == 2
    assert np.array_equal(runs.runs[1].cols, [*range(8), *range(10, 15)])
    assert np.array_equal(runs.runs[2].cols, [*range(5), *range(15, 20)])
    cpu = torch.device("cpu")  # a gathered run's index goes to the device once for every layer
    assert runs.columns(1, cpu) is runs.columns(1, cpu) and runs.columns(0, cpu) == slice(0, 10)
    assert torch.equal(runs.columns(2, cpu), torch.as_tensor(runs.runs[2].cols))
    # the first branch as a chunk of its own over its ancestors kept before it: one view
    chunk = plan_runs(last_desc, 10, 15, np.array([*range(8), *range(10, 15)]))
    assert [(r.lo, r.hi, r.cols) for r in chunk.runs] == [(0, 5, slice(0, 13))] and chunk.keys == 13


def test_runs_refuse_keys_that_do_not_end_with_the_queries() -> None:
    with pytest.raises(ValueError, match="end with the queries"):
        plan_runs(BIG.last_desc, 10, 20, np.arange(0, 15))
    with pytest.raises(ValueError, match="not among the keys"):
        plan_runs(BIG.last_desc, 300, 400, np.arange(300, 400))  # the ancestors before 300 left out


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    scale = max(float(g.abs().max()) for g in want.values())
    assert scale > 0 and got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], atol=1e-6 * scale, rtol=1e-4, msg=n)


@pytest.mark.long
@pytest.mark.parametrize("budget", [300, 100_000, 64])
def test_tree_attention_trains_as_the_dense_mask_does(budget: int) -> None:
    """Whole (one chunk) and in chunks over kept keys and values (in place and gathered), on one model
    (the default suite has the same through micro_gradient, a flex model against a dense one)."""
    model = build_model(ModelConfig())
    cfg = LossConfig(mode="tis")
    model.zero_grad()
    want = chunked_loss_backward(model, BIG, budget, cfg, "dense")
    ref = _grads(model)
    model.zero_grad()
    with attention_implementation(model, "tree"):
        got = chunked_loss_backward(model, BIG, budget, cfg, "tree")
    assert model.config._attn_implementation == "sdpa"  # back to what it was
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-6)
    _assert_close(_grads(model), ref)


def test_a_model_not_switched_to_tree_attention_refuses_its_runs() -> None:
    # SDPA would ignore the runs and attend causally over the whole packed sequence, silently wrong
    model = build_model(ModelConfig())
    with pytest.raises(ValueError, match="need a model computing with 'gyre_tree'"):
        chunked_loss_backward(model, BIG, 300, LossConfig(), "tree")


def test_a_flex_model_trains_chunked_micro_batches_with_tree_attention() -> None:
    """On a FlexAttention model (the GPU's) a chunked micro-batch up to the limit computes with tree
    attention (nothing compiled): the gradient of a dense model's, and the model is a FlexAttention one
    again afterwards. Larger ones keep FlexAttention; a dense model keeps its own."""
    from gyre_train.defaults import TREE_CHUNK_ELEMENTS
    from gyre_train.model import chunk_attention

    assert chunk_attention("flex", 16_384, 27_000) == "tree"  # the agentic run's 27k trees in 16k chunks
    assert chunk_attention("flex", 8_192, 698_000) == "flex"  # a 700k tree: branches' gathers too large
    assert chunk_attention("dense", 8_192, 27_000) == "dense"
    assert chunk_attention("flex", 1 << 15, TREE_CHUNK_ELEMENTS >> 15) == "tree"
    mc = ModelConfig()
    dense, flex = build_model(mc, "dense"), build_model(mc, "flex")
    flex.load_state_dict(dense.state_dict())
    layout = Layout.of(dense)
    cfg = LossConfig()
    want, _ = micro_gradient(dense, layout, BIG, cfg, "dense", chunk_budget=300)
    got, m = micro_gradient(flex, layout, BIG, cfg, "flex", chunk_budget=300)
    assert m["shared_chunks"] >= 1
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, atol=1e-6 * scale, rtol=1e-4)
    assert flex.config._attn_implementation == "flex_attention"


def test_a_flex_model_trains_whole_micro_batches_with_tree_attention_and_reports_the_same_metrics() -> None:
    """A micro-batch within the chunk budget on a FlexAttention model: one chunk of its own size with tree
    attention (no FlexAttention compiled at all), the gradient and the metrics (loss, tokens, weighted
    means with their weight, entropy, mismatch sums) of a dense model computing it in one piece."""
    from gyre_train.model import chunk_attention

    assert chunk_attention("flex", 12_000, 12_000) == "tree"
    mc = ModelConfig()
    dense, flex = build_model(mc, "dense"), build_model(mc, "flex")
    flex.load_state_dict(dense.state_dict())
    layout = Layout.of(dense)
    cfg = LossConfig(mode="ppo")
    want, wm = micro_gradient(dense, layout, BIG, cfg, "dense")
    got, gm = micro_gradient(flex, layout, BIG, cfg, "flex", chunk_budget=100_000)
    assert gm["chunks"] == 1.0 and "chunks" not in wm  # the tree path, not gyre-traj's forward
    torch.testing.assert_close(got, want, atol=1e-6 * float(want.abs().max()), rtol=1e-4)
    same = ("loss", "tokens", "ratio_mean", "clip_frac", "approx_kl", "entropy", "weight", "mismatch_tokens")
    for k in same:
        assert gm[k] == pytest.approx(wm[k], rel=1e-4, abs=1e-6), k
    assert flex.config._attn_implementation == "flex_attention"


def test_target_logprobs_of_a_flex_model_are_the_dense_models() -> None:
    """What `gyre-train mismatch` compares with the engine: the forward micro_gradient trains with, tree
    attention on a FlexAttention model, equal to the dense model's."""
    from gyre_train.model import target_logprobs_of

    mc = ModelConfig()
    dense, flex = build_model(mc, "dense"), build_model(mc, "flex")
    flex.load_state_dict(dense.state_dict())
    want = target_logprobs_of(dense, BIG, "dense")
    got = target_logprobs_of(flex, BIG, "flex")
    assert got.shape == (BIG.num_loss_tokens,)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert flex.config._attn_implementation == "flex_attention"
