"""The rotary kernel on a GPU: bit for bit transformers' `apply_rotary_pos_emb` in bfloat16 and float16
(the engine's dtypes there) on the Qwen3-0.6B heads, at a decode step's and a prefill's shapes, and an
engine that replaces the function serves the same greedy tokens as one that does not (float32 tiny
model, its own modeling file's function put back after). Skipped without CUDA."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from gyre_engine.server import rotary as rot  # noqa: E402
from gyre_engine.server.rotary import triton_rotary  # noqa: E402
from gyre_engine.server.serve import ServeConfig, load_engine  # noqa: E402
from transformers.models.qwen3 import modeling_qwen3  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # the shared checks (tests run with --import-mode=importlib)
import slot_checks  # noqa: E402

THEIRS = getattr(modeling_qwen3.apply_rotary_pos_emb, "gyre_original", modeling_qwen3.apply_rotary_pos_emb)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,t", [(8, 1), (64, 1), (3, 700)])
def test_kernel_is_transformers_bit_for_bit(dtype: torch.dtype, b: int, t: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(b * t)
    q = (3 * torch.randn(b, t, 16, 128, device="cuda", generator=g)).to(dtype).transpose(1, 2)
    k = (3 * torch.randn(b, t, 8, 128, device="cuda", generator=g)).to(dtype).transpose(1, 2)
    pos = torch.randint(0, 30000, (b, t), device="cuda", generator=g).float()
    freq = 1e6 ** (-torch.arange(0, 128, 2, device="cuda") / 128)
    ang = torch.cat([pos[..., None] * freq] * 2, dim=-1)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    got, want = triton_rotary(q, k, cos, sin), THEIRS(q, k, cos, sin)
    for x, y in zip(got, want, strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert all(a == c for a, c, n in zip(x.stride(), y.stride(), x.shape, strict=True) if n > 1)
        assert torch.equal(x, y), float((x.float() - y.float()).abs().max())


def test_an_engine_with_the_kernel_serves_what_one_without_serves(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def greedy(fuse: bool) -> dict[str, list[int]]:  # three agents' calls: decode, packed and slot prefills
        cfg = slot_checks.slot_prefill_config(64, "graphs", 256)
        cfg.fuse_rotary = fuse
        e = load_engine(ServeConfig(model=str(model_dir), device="cuda", engine=cfg))
        try:
            return slot_checks.agent_calls(e)[0]
        finally:
            e.shutdown()

    monkeypatch.setattr(modeling_qwen3, "apply_rotary_pos_emb", THEIRS)
    calls = [0]
    op = rot.rotary

    def counted(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls[0] += 1
        return op(*args)

    monkeypatch.setattr(rot, "rotary", counted)
    plain = greedy(False)
    assert modeling_qwen3.apply_rotary_pos_emb is THEIRS and calls[0] == 0
    fused = greedy(True)
    assert getattr(modeling_qwen3.apply_rotary_pos_emb, "gyre_original", None) is THEIRS
    assert calls[0] > 0, "this transformers' attention does not call its modeling file's function"
    assert fused == plain
