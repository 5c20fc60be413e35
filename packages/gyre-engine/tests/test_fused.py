"""Fused projections (`server/fused.py`): a model whose q/k/v and gate/up projections run as one GEMM
each gives the logits of the unfused model, keeps its parameter names and shapes, takes weight updates
that copy into its parameters, survives its parameters moving (`refresh`), and traces as one graph."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from gyre_engine.server.fused import FusedLinear, FusedProjections  # noqa: E402
from gyre_engine.server.weights import apply_named_tensors  # noqa: E402


def _pair(model_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    fused = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    return ref, fused


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def test_fused_model_equals_the_model_and_keeps_its_parameters(model_dir: Path) -> None:
    ref, m = _pair(model_dir)
    names = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    f = FusedProjections(m)
    layers = m.config.num_hidden_layers
    assert len(f) == 2 * layers  # q/k/v and gate/up of every layer
    assert {k: tuple(v.shape) for k, v in m.state_dict().items()} == names
    attn = m.model.layers[0].self_attn
    assert all(isinstance(getattr(attn, n), FusedLinear) for n in ("q_proj", "k_proj", "v_proj"))
    base = attn.q_proj.weight.data_ptr()  # q, k, v are consecutive rows of one tensor
    assert (
        attn.k_proj.weight.data_ptr() == base + attn.q_proj.weight.numel() * attn.q_proj.weight.element_size()
    )
    ids = torch.randint(1, m.config.vocab_size, (3, 11))
    assert torch.equal(_logits(m, ids), _logits(ref, ids))


def test_updates_copied_into_parameters_reach_the_fused_gemm(model_dir: Path, tmp_path: Path) -> None:
    ref, m = _pair(model_dir)
    FusedProjections(m)
    torch.manual_seed(3)
    new = {
        name: torch.randn_like(t) * 0.05
        for name, t in ref.state_dict().items()
        if any(p in name for p in ("q_proj", "v_proj", "up_proj"))
    }
    with torch.no_grad():
        apply_named_tensors(m, new)
        apply_named_tensors(ref, new)
    ids = torch.randint(1, m.config.vocab_size, (2, 9))
    assert torch.equal(_logits(m, ids), _logits(ref, ids))


def test_moved_parameters_are_fused_again(model_dir: Path) -> None:
    """`.to(dtype)` (like release/resume's `.to(device)`) gives every parameter new storage: the groups
    notice and rebuild; `drop` forgets the fused tensors."""
    ref, m = _pair(model_dir)
    f = FusedProjections(m)
    assert f.refresh() == 0
    m.double()
    assert f.refresh() == len(f)
    ids = torch.randint(1, m.config.vocab_size, (2, 7))
    assert torch.allclose(_logits(m, ids), _logits(ref.double(), ids), atol=1e-12)
    with torch.no_grad():  # and updates after the rebuild still land in the fused weight
        m.model.layers[1].mlp.gate_proj.weight.mul_(0.5)
        ref.model.layers[1].mlp.gate_proj.weight.mul_(0.5)
    assert torch.allclose(_logits(m, ids), _logits(ref, ids), atol=1e-12)
    f.drop()
    assert all(g.weight is None for g in f.groups)
    with pytest.raises(AssertionError, match="refresh"):
        _logits(m, ids)
    assert f.refresh() == len(f)
    assert torch.allclose(_logits(m, ids), _logits(ref, ids), atol=1e-12)


def test_members_called_with_other_inputs_recompute() -> None:
    """The group reuses its GEMM only for the same input object; anything else is computed afresh."""
    torch.manual_seed(0)

    class Attn(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = torch.nn.Linear(8, 6, bias=True)
            self.k_proj = torch.nn.Linear(8, 4, bias=True)
            self.v_proj = torch.nn.Linear(8, 4, bias=True)

    a = Attn()
    w = {
        n: (getattr(a, n).weight.clone(), getattr(a, n).bias.clone()) for n in ("q_proj", "k_proj", "v_proj")
    }
    f = FusedProjections(a)
    assert len(f) == 1
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    with torch.no_grad():
        outs = [a.q_proj(x), a.k_proj(y), a.v_proj(x), a.v_proj(y), a.q_proj(y)]
    want = [(x, "q_proj"), (y, "k_proj"), (x, "v_proj"), (y, "v_proj"), (y, "q_proj")]
    for got, (inp, n) in zip(outs, want, strict=True):
        assert torch.allclose(got, torch.nn.functional.linear(inp, *w[n]))


def test_qwen2_style_biases_are_fused(tmp_path: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(1)
    ref = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.1)  # non-zero biases
    m = Qwen2ForCausalLM(cfg).eval()
    m.load_state_dict(ref.state_dict())
    f = FusedProjections(m)
    assert len(f) == 4 and f.groups[0].bias is not None
    ids = torch.randint(0, 300, (2, 10))
    assert torch.allclose(_logits(m, ids), _logits(ref, ids), atol=1e-6)


@pytest.mark.slow
def test_fused_forward_traces_as_one_graph(model_dir: Path) -> None:
    """torch.compile sees through the group (no graph break), which the decode step's capture needs."""
    import torch._dynamo

    _, m = _pair(model_dir)
    FusedProjections(m)
    ids = torch.randint(1, m.config.vocab_size, (2, 5))
    with torch.no_grad():
        ex = torch._dynamo.explain(lambda x: m(x).logits)(ids)
    assert ex.graph_break_count == 0 and ex.graph_count == 1, ex.break_reasons
