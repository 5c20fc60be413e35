"""A long prefill's attention on a GPU (`long_kv.chunk_attention`): flash attention over the grouped KV
heads, whole or split at the chunk's own columns, against a float32 reference with the mask built, at the
Qwen3-0.6B head shape, with keys and values strided views of a larger buffer as a long slot's are. Also
that a GPU with flash attention (compute capability 8 and up) does not fall back to repeating the KV
heads. Skipped without CUDA."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from gyre_engine.server.long_kv import chunk_attention, chunk_attention_path  # noqa: E402


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k, v = (t.float().repeat_interleave(group, dim=1) for t in (k, v))
    n, width = q.shape[2], k.shape[2]
    scores = (q.float() @ k.transpose(-1, -2)) * scale
    rows = torch.arange(n, device=q.device)[:, None] + width - n
    scores = scores.masked_fill(torch.arange(width, device=q.device)[None] > rows, float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize(("n", "width"), [(512, 512), (512, 8192), (64, 20_000), (1, 3000)])
def test_chunk_attention_matches_the_reference_without_repeating_kv_heads(n: int, width: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(n + width)
    heads, kv_heads, d = 16, 8, 128
    buf = torch.randn((2, 1, kv_heads, width + 1024, d), generator=gen, device="cuda").to(torch.bfloat16)
    k, v = buf[0, :, :, :width], buf[1, :, :, :width]
    q = torch.randn((1, n, heads, d), generator=gen, device="cuda").to(torch.bfloat16).transpose(1, 2)
    path = chunk_attention_path(q, k)
    if torch.cuda.get_device_capability() >= (8, 0):
        assert path in ("flash", "flash-split"), path
    got = chunk_attention(q, k, v, d**-0.5).float()
    err = float((got - _reference(q, k, v, d**-0.5)).abs().max())
    assert err < 0.05, (path, err)
