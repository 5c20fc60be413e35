"""A long prefill's attention split in two (`long_kv.split_attention`): a chunk's queries over the prefix
without a mask and over their own columns with the square causal mask, merged by log-sum-exp, equal the
chunk's causal attention over the whole (the bottom-right-aligned mask). On CUDA the two parts are flash
attention's; here each part is computed in float64 with its mask built, so the merge is what is tested.
The flash kernels themselves are checked on the GPU (`tests/test_chunk_attention_cuda.py`)."""

from __future__ import annotations

import pytest
import torch
from gyre_engine.server.long_kv import Attend, chunk_attention, chunk_attention_path, split_attention
from hypothesis import given, settings
from hypothesis import strategies as st


def _attend_math(scale: float) -> Attend:
    """An `Attend` in float64: each query's softmax over its keys (top-left causal when asked: for the
    square part, the same as bottom right), with its log-sum-exp."""

    def attend(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1).double(), v.repeat_interleave(group, dim=1).double()
        scores = (q.double() @ k.transpose(-1, -2)) * scale
        if causal:
            n, width = scores.shape[-2:]
            scores = scores.masked_fill(torch.ones(n, width, dtype=torch.bool).triu(1), float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        return (torch.exp(scores - lse[..., None]) @ v).to(q.dtype), lse.float()

    return attend


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The chunk's causal attention over all the columns, bottom-right aligned (query i at column
    L - n + i), in float64."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1).double(), v.repeat_interleave(group, dim=1).double()
    n, width = q.shape[2], k.shape[2]
    scores = (q.double() @ k.transpose(-1, -2)) * scale
    rows = torch.arange(n)[:, None] + width - n
    scores = scores.masked_fill(torch.arange(width)[None] > rows, float("-inf"))
    return scores.softmax(-1) @ v


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 40),
    prefix=st.integers(0, 120),
    kv_heads=st.sampled_from([1, 2, 4]),
    group=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 2**16),
)
def test_split_attention_equals_the_chunks_causal_attention(
    n: int, prefix: int, kv_heads: int, group: int, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    d = 16
    q = torch.randn((1, kv_heads * group, n, d), generator=gen)
    k, v = (torch.randn((1, kv_heads, prefix + n, d), generator=gen) for _ in range(2))
    scale = d**-0.5
    got = split_attention(q, k, v, _attend_math(scale))
    want = _reference(q, k, v, scale)
    assert torch.allclose(got.double(), want, atol=1e-5), float((got.double() - want).abs().max())


def test_on_the_cpu_the_mask_is_built_and_the_result_is_the_same() -> None:
    gen = torch.Generator().manual_seed(3)
    q = torch.randn((1, 8, 24, 16), generator=gen)
    k, v = (torch.randn((1, 2, 100, 16), generator=gen) for _ in range(2))
    assert chunk_attention_path(q, k) == "masked"
    got = chunk_attention(q, k, v, 0.25)
    assert torch.allclose(got.double(), _reference(q, k, v, 0.25), atol=1e-5)
    with pytest.raises(AssertionError):  # (the reference tells a misaligned mask apart)
        top_left = _attend_math(0.25)(q, k, v, True)[0]
        assert torch.allclose(top_left.double(), _reference(q, k, v, 0.25), atol=1e-5)
