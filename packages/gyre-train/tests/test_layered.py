"""A tree whose trunk is too long for the kept keys/values of every layer, trained layer by layer
(`layered.py`): the loss and every gradient equal those of the whole tree as one micro-batch (float64, so
equal to float rounding), with the layer inputs on the device or copied out to the host store and back;
the host store hands back each layer's input exactly, in any order."""

from __future__ import annotations

import pytest
import torch
from gyre_train.bench.run import Fan, fan_tree, packs
from gyre_train.chunked import chunked_loss_backward, plan
from gyre_train.layered import TreeMemoryError, choose, layered_bytes, layered_loss_backward, pick_method
from gyre_train.layerstore import LayerStore
from gyre_train.model import ModelConfig, build_model
from gyre_traj.loss import LossConfig, TorchBatch, policy_loss, target_logprobs
from gyre_traj.pack import PackedBatch


def _model() -> torch.nn.Module:
    return build_model(ModelConfig()).double()


def _tree(branches: int = 4) -> PackedBatch:
    return packs(fan_tree(Fan(1024, branches, 160), seed=7), branches)[0][0]


def _reference(
    model: torch.nn.Module, b: PackedBatch, cfg: LossConfig
) -> tuple[float, dict[str, torch.Tensor]]:
    tb = TorchBatch.from_packed(b)
    model.zero_grad()
    loss, _ = policy_loss(target_logprobs(model, tb), tb, cfg)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(model: torch.nn.Module, ref: dict[str, torch.Tensor], tol: float = 1e-11) -> None:
    scale = max(float(g.abs().max()) for g in ref.values())
    for n, p in model.named_parameters():
        assert p.grad is not None, n
        torch.testing.assert_close(p.grad, ref[n], atol=tol * scale, rtol=100 * tol, msg=n)


@pytest.mark.parametrize("host", [False, True])
@pytest.mark.parametrize("budget", [256, 200])  # cuts at branch starts / inside branches (gathered joins)
def test_layered_gradient_equals_one_microbatch(host: bool, budget: int) -> None:
    model, b, cfg = _model(), _tree(), LossConfig(mode="ppo")
    loss, ref = _reference(model, b, cfg)
    model.zero_grad()
    m = layered_loss_backward(model, b, budget, cfg, loss_slice=37, host=host)
    assert m["chunks"] >= 6 and m["shared_chunks"] >= 4
    # gyre-traj's one-micro-batch loss takes its log-softmax in float32: equal to that rounding
    assert abs(m["loss"] - loss) <= 1e-6 * abs(loss)
    _assert_same(model, ref, 1e-6)
    layers = model.config.num_hidden_layers
    assert m["host_copies"] == (2 * layers if host else 0)  # each layer out once and back once
    assert m["host_bytes"] == (layered_bytes(b, budget, model, True)["host_bytes"] if host else 0)


@pytest.mark.parametrize("host", [False, True])
@pytest.mark.parametrize(("budget", "mode"), [(256, "tis"), (200, "ppo")])
def test_layered_equals_kept_method_in_float64(host: bool, budget: int, mode: str) -> None:
    """Both memory methods of one tree (both float64 throughout) give the same loss and gradient to float64
    rounding, and join the same chunks in place."""
    model, b, cfg = _model(), _tree(3), LossConfig(mode=mode)  # type: ignore[arg-type]
    model.zero_grad()
    a = chunked_loss_backward(model, b, budget, cfg)
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    m = layered_loss_backward(model, b, budget, cfg, loss_slice=50, host=host)
    assert abs(m["loss"] - a["loss"]) <= 1e-12 * abs(a["loss"])
    assert m["joined_in_place"] == a["joined_in_place"] and m["joined_gathered"] == a["joined_gathered"]
    _assert_same(model, ref)


def test_host_store_returns_each_layer_exactly_in_any_order() -> None:
    """Layer inputs put in order and fetched in reverse (with prefetches ahead, as the backward sweep does)
    and at random come back bit for bit: a lost, stale or swapped layer fails here."""
    g = torch.Generator().manual_seed(1)
    hs = [torch.randn(50, 8, generator=g, dtype=torch.float64) for _ in range(5)]
    st = LayerStore(5, 50, 8, torch.float64, torch.device("cpu"), host=True)
    for i, h in enumerate(hs):
        st.put(i, h)
        h.zero_()  # the caller reuses its buffer: the store must hold a copy
    fresh = [torch.randn(50, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)]
    torch.testing.assert_close(st.get(0), fresh[0], rtol=0, atol=0)
    g = torch.Generator().manual_seed(1)
    want = [torch.randn(50, 8, generator=g, dtype=torch.float64) for _ in range(5)]
    for i in (4, 3, 1, 2, 0):
        if i:
            st.prefetch(i - 1)
        torch.testing.assert_close(st.get(i), want[i], rtol=0, atol=0)
    with pytest.raises(IndexError, match="layer 5"):
        st.get(5)
    with pytest.raises(ValueError, match="shape"):
        st.put(0, torch.zeros(49, 8, dtype=torch.float64))


def test_choose_on_cpu_and_plan_of_the_bench_tree() -> None:
    model, b = _model(), _tree()
    assert choose(b, 256, model, "auto") == "kept"
    assert choose(b, 256, model, "layers-host") == "layers-host"
    assert len(plan(b, 256)) >= 6


def test_pick_method_takes_the_first_that_fits_and_names_the_bytes_when_none_does() -> None:
    gib = 2**30
    need = {"kept": (213 * gib, 0), "layers": (55 * gib, 0), "layers-host": (18 * gib, 37 * gib)}
    assert pick_method(need, "auto", 140 * gib, 120 * gib, "t") == "layers"  # type: ignore[arg-type]
    assert pick_method(need, "auto", 40 * gib, 120 * gib, "t") == "layers-host"  # type: ignore[arg-type]
    assert pick_method(need, "layers-host", 140 * gib, 120 * gib, "t") == "layers-host"  # type: ignore[arg-type]
    with pytest.raises(
        TreeMemoryError,
        match=r"tree of 7 tokens .*kept: 213.0 GiB device.*layers-host: 18.0 GiB device \+ 37.0 GiB host.*free: 20.0 GiB device, 30.0 GiB host",
    ):
        pick_method(need, "auto", 20 * gib, 30 * gib, "tree of 7 tokens")  # type: ignore[arg-type]
    with pytest.raises(TreeMemoryError, match="chunk_memory='kept'"):
        pick_method(need, "kept", 140 * gib, 120 * gib, "t")  # type: ignore[arg-type]
