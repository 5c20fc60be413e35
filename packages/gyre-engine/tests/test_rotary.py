"""The rotary embedding as one kernel (`server/rotary.py`): the torch reference is transformers' function,
`fuse_rotary` replaces a modeling file's function only where that function computes the formula and the
replacement falls back to it wherever the kernel does not apply (gradients, other calls), and the Triton
kernel equals transformers' function bit for bit in float32 and float16 in Triton's CPU interpreter (a
subprocess with TRITON_INTERPRET=1; bfloat16, which the interpreter rounds its own way, in the CUDA
test)."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
from gyre_engine.server import rotary as rot  # noqa: E402
from transformers.models.qwen3 import modeling_qwen3  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # the shared helpers (tests run with --import-mode=importlib)
from interpret import interpret  # noqa: E402
from tiny_models import tiny_qwen3  # noqa: E402

THEIRS = getattr(modeling_qwen3.apply_rotary_pos_emb, "gyre_original", modeling_qwen3.apply_rotary_pos_emb)


@settings(max_examples=30, deadline=None)
@given(
    b=st.integers(1, 3),
    heads=st.sampled_from([(4, 2), (2, 2), (16, 8)]),
    t=st.integers(1, 6),
    d=st.sampled_from([2, 6, 8, 64]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_reference_is_transformers_function(
    b: int, heads: tuple[int, int], t: int, d: int, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(b * t * d)
    q = torch.randn(b, t, heads[0], d, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(b, t, heads[1], d, generator=g).to(dtype).transpose(1, 2)
    cos, sin = torch.randn(1, t, d, generator=g).to(dtype), torch.randn(1, t, d, generator=g).to(dtype)
    want = THEIRS(q, k, cos, sin)
    for got in (
        rot.reference_rotary(q, k, cos, sin),
        rot.rotary(q, k, cos, sin),
    ):  # off Triton: the reference
        assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))


@pytest.fixture
def modeling(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """Qwen3's modeling file with its own function back in place after the test."""
    monkeypatch.setattr(modeling_qwen3, "apply_rotary_pos_emb", THEIRS)
    return modeling_qwen3


def test_fuse_replaces_the_modeling_files_function_once_and_changes_no_output(
    modeling: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_qwen3()
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        want = model(ids).logits
    assert rot.fuse_rotary(model) == [modeling.__name__]
    fused = modeling.apply_rotary_pos_emb
    assert fused is not THEIRS and fused.gyre_original is THEIRS
    assert rot.fuse_rotary(model) == [modeling.__name__] and modeling.apply_rotary_pos_emb is fused  # once
    calls: list[str] = []
    monkeypatch.setattr(rot, "rotary", lambda *a: calls.append("kernel") or rot.reference_rotary(*a))
    monkeypatch.setattr(rot, "available", lambda device: True)  # as on a GPU: the kernel's path is taken
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
    assert calls == ["kernel"] * 2  # one call a layer
    calls.clear()
    model(ids).logits.sum().backward()  # a model being trained gets transformers' function
    assert calls == [] and all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_the_replacement_falls_back_for_other_calls(
    modeling: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    rot.fuse_rotary(tiny_qwen3())
    calls: list[str] = []
    monkeypatch.setattr(rot, "rotary", lambda *a: calls.append("kernel") or rot.reference_rotary(*a))
    monkeypatch.setattr(rot, "available", lambda device: True)
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    cos, sin = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    fused = modeling.apply_rotary_pos_emb
    for args, kw in (
        ((q, k, cos, sin), {}),
        ((q, k, cos, sin), {"unsqueeze_dim": 1}),
        ((q.transpose(1, 2), k.transpose(1, 2), cos, sin), {"unsqueeze_dim": 2}),  # another layout
        ((q, k, cos[0], sin[0]), {"unsqueeze_dim": 0}),  # cos/sin without their batch
        ((q[..., :7], k[..., :7], cos[..., :7], sin[..., :7]), {}),  # an odd head dimension
    ):
        calls.clear()
        got = fused(*args, **kw)
        want = THEIRS(*args, **kw)
        assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
        usual = args[2].dim() == 3 and args[0].shape[-1] == 8 and kw.get("unsqueeze_dim", 1) == 1
        assert calls == (["kernel"] if usual else [])


def test_a_kernel_that_fails_leaves_transformers_function_for_good(
    modeling: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    rot.fuse_rotary(tiny_qwen3())
    calls: list[str] = []

    def broken(*a: Any) -> Any:
        calls.append("kernel")
        raise RuntimeError("no kernel for this GPU")

    monkeypatch.setattr(rot, "rotary", broken)
    monkeypatch.setattr(rot, "available", lambda device: True)
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    cos, sin = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    for _ in range(3):
        got = modeling.apply_rotary_pos_emb(q, k, cos, sin)
        assert all(torch.equal(x, y) for x, y in zip(got, THEIRS(q, k, cos, sin), strict=True))
    assert calls == ["kernel"]  # tried once


def test_a_function_that_is_not_the_formula_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    file = types.ModuleType("gyre_test_modeling_other")

    def apply_rotary_pos_emb(q: Any, k: Any, cos: Any, sin: Any, unsqueeze_dim: int = 1) -> Any:
        return q * cos.unsqueeze(1), k * sin.unsqueeze(1)  # another embedding

    file.apply_rotary_pos_emb = apply_rotary_pos_emb  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, file.__name__, file)

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj, self.k_proj = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)

    Attention.__module__ = file.__name__
    assert rot.fuse_rotary(torch.nn.Sequential(Attention())) == []
    assert file.apply_rotary_pos_emb is apply_rotary_pos_emb


@pytest.mark.slow
def test_triton_kernel_equals_transformers_in_the_interpreter() -> None:
    """Grouped heads, several tokens and batch rows, cos/sin shared by the batch or per row, head
    dimensions of a power of two and not, and q/k as the attention hands them over (a transposed view
    of [B, T, heads, D])."""
    code = """
        import torch
        from gyre_engine.server.rotary import available, rotary, triton_rotary
        from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb
        assert available(torch.device("cpu"))
        torch.manual_seed(0)
        for b, hq, hk, t, d, cb in [(2, 4, 2, 5, 8, 1), (1, 16, 8, 3, 128, 1), (3, 2, 2, 1, 6, 3), (2, 3, 1, 4, 24, 2)]:
            for dtype in (torch.float32, torch.float16):
                q = (3 * torch.randn(b, t, hq, d)).to(dtype).transpose(1, 2)
                k = (3 * torch.randn(b, t, hk, d)).to(dtype).transpose(1, 2)
                cos, sin = torch.randn(cb, t, d).to(dtype), torch.randn(cb, t, d).to(dtype)
                want = apply_rotary_pos_emb(q, k, cos, sin)
                for got in (triton_rotary(q, k, cos, sin), rotary(q, k, cos, sin)):
                    for x, y in zip(got, want, strict=True):
                        assert x.shape == y.shape and x.dtype == y.dtype, (x.shape, y.shape)
                        assert all(a == c for a, c, n in zip(x.stride(), y.stride(), x.shape) if n > 1)
                        assert torch.equal(x, y), (b, hq, hk, t, d, dtype, float((x - y).abs().max()))
        print("ok")
    """
    assert interpret(code, timeout=300).strip().endswith("ok")
