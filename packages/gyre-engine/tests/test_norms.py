"""Fused RMS norms (`server/norms.py`): the torch reference is transformers' forward, the replaced modules
keep their parameters and compute the same, and the Triton kernel equals the reference in Triton's CPU
interpreter (a subprocess with TRITON_INTERPRET=1; on the GPU the engine's CUDA tests run it in bf16)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
from gyre_engine.server.norms import (  # noqa: E402
    NORM_CLASSES,
    FusedRMSNorm,
    fuse_rms_norms,
    reference_rms_norm,
    rms_norm,
)
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # the shared helpers (tests run with --import-mode=importlib)
from interpret import interpret  # noqa: E402
from tiny_models import tiny_qwen3  # noqa: E402


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 9),
    cols=st.sampled_from([1, 7, 128, 1000]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    eps=st.sampled_from([1e-6, 1e-5]),
)
def test_reference_is_transformers_forward(rows: int, cols: int, dtype: torch.dtype, eps: float) -> None:
    g = torch.Generator().manual_seed(rows * cols)
    m = Qwen3RMSNorm(cols, eps=eps).to(dtype)
    with torch.no_grad():
        m.weight.copy_(torch.randn(cols, generator=g))
    x = (3 * torch.randn(rows, 2, cols, generator=g)).to(dtype)
    assert torch.equal(reference_rms_norm(x, m.weight, eps), m(x))
    assert torch.equal(rms_norm(x, m.weight, eps), m(x))  # off Triton the op is the reference


def test_fused_modules_keep_their_parameters_and_output() -> None:
    """Every Qwen3RMSNorm (2 a layer, query and key norms, the final one) is replaced, still an instance
    of its class, with the same state_dict, and the model's logits are unchanged (the reference runs
    here)."""
    model = tiny_qwen3()
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        want = model(ids).logits
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert fuse_rms_norms(model) == 2 * 4 + 1
    norms = [m for m in model.modules() if isinstance(m, Qwen3RMSNorm)]
    assert len(norms) == 9 and all(isinstance(m, FusedRMSNorm) for m in norms)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
        norms[0].weight.mul_(2.0)  # a weight update lands in the fused module's own parameter
        assert not torch.equal(model(ids).logits, want)


def test_only_known_classes_are_replaced() -> None:
    class GemmaLikeRMSNorm(torch.nn.Module):  # (1 + weight): not the formula
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(4))
            self.variance_epsilon = 1e-6

    model = torch.nn.Sequential(GemmaLikeRMSNorm(), Qwen3RMSNorm(4))
    assert "GemmaLikeRMSNorm" not in NORM_CLASSES
    assert fuse_rms_norms(model) == 1
    assert not isinstance(model[0], FusedRMSNorm) and isinstance(model[1], FusedRMSNorm)


@pytest.mark.slow
def test_triton_kernel_equals_the_reference_in_the_interpreter() -> None:
    """Widths of a hidden state and of a head (several rows a program), widths that are not a power of
        two, a row count that is not a multiple of the program's rows, and strided inputs: heads of a slice of
    a wider projection (read in place), and views that must be copied first."""
    pytest.importorskip("triton")
    code = """
        import torch
        from gyre_engine.server.norms import available, rms_norm, reference_rms_norm, triton_rms_norm
        assert available(torch.device("cpu"))
        torch.manual_seed(0)
        for shape in [(3, 5, 1024), (2, 7, 16, 128), (13, 100), (1, 1, 3)]:
            for dtype in (torch.float32, torch.float16):
                x = (3 * torch.randn(*shape)).to(dtype)
                w = torch.randn(shape[-1]).to(dtype)
                want = reference_rms_norm(x, w, 1e-6)
                for got in (triton_rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6)):
                    assert got.dtype == want.dtype and got.shape == want.shape
                    tol = 1e-5 if dtype == torch.float32 else 2e-2  # a rounding of float16 at most
                    err = float((got.float() - want.float()).abs().max())
                    assert err <= tol * float(want.float().abs().max()), (shape, dtype, err)
        w = torch.randn(64)
        for x in (
            torch.randn(4, 2, 64).transpose(0, 1),  # leading dimensions that do not merge: copied
            torch.randn(2, 3, 4 * 64 + 96)[..., 32 : 32 + 4 * 64].view(2, 3, 4, 64),  # heads of a slice
            torch.randn(5, 64 * 3)[:, ::3],  # a last dimension that is not contiguous
        ):
            got, want = triton_rms_norm(x, w, 1e-6), reference_rms_norm(x, w, 1e-6)
            assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5), x.stride()
        print("ok")
    """
    assert interpret(code, timeout=300).strip().endswith("ok")
