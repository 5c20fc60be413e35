"""Fused RMS norms: each RMSNorm module of the engine's model runs as one Triton kernel on CUDA, where
transformers' forward runs seven (to float32, square, mean, add epsilon, reciprocal square root,
multiply, back to the input's dtype, times the weight).

Why: a decode step of the Qwen3-0.6B shape launches about 1,600 kernels (on one H100 under the
agent-shaped load of `bench/agentic_load.py`), most of them elementwise kernels over a few rows that each
cost the GPU a few microseconds whatever their size; its 113 RMS norms a step (the layer's two, the
attention's query and key norms, the final one) are about 790 of them. Inside the step's CUDA graph one
kernel per norm removes about 680.

The kernel computes what transformers' Llama-style RMSNorm computes: in float32, x times the reciprocal
square root of the mean of its squares plus epsilon, rounded to the input's dtype, then times the weight
in the dtype the two promote to. The sum of squares is reduced in another order than torch's, so an
output can differ from torch's by a rounding of the input's dtype. The modules keep their class's
parameters and names (weight updates and release/resume move the same `weight`); only their forward
changes. Off CUDA, or without Triton, the op runs that forward in torch (the CPU tests check the kernel
through Triton's interpreter). Only the classes in `NORM_CLASSES` are replaced, whose forward is that
formula; others (Gemma's `1 + weight`, for one) keep theirs.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from gyre_engine.server.decode_attn import triton_available as available

try:  # Triton comes with torch's CUDA builds
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

log = logging.getLogger(__name__)

NORM_CLASSES = frozenset(
    {"Qwen3RMSNorm", "Qwen2RMSNorm", "LlamaRMSNorm", "MistralRMSNorm", "Qwen3MoeRMSNorm"}
)
"""transformers classes whose forward is w * (x * rsqrt(mean(x^2) + eps)).to(x.dtype) over the last
dimension, with `weight` and `variance_epsilon`."""


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' forward of those classes."""
    dt = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dt)


if triton is not None:

    @triton.jit
    def _rms_kernel(  # type: ignore[no-untyped-def]
        X, W, Y, rows, inner, sx_o, sx_i, cols, eps,
        ROWS: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        # row r of the input is (r // inner, r % inner) of a [outer, inner, cols] view with strides
        # (sx_o, sx_i, 1): the query and key slices of a fused projection are read where they lie
        r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        c = tl.arange(0, BLOCK)
        m = (r[:, None] < rows) & (c[None, :] < cols)
        at = (r // inner) * sx_o + (r % inner) * sx_i
        x = tl.load(X + at[:, None] + c[None, :], mask=m, other=0.0).to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(x * x, 1) / cols + eps)
        h = (x * inv[:, None]).to(X.dtype.element_ty).to(tl.float32)
        w = tl.load(W + c, mask=c < cols, other=0.0).to(tl.float32)
        tl.store(Y + r[:, None] * cols + c[None, :], (h * w[None, :]).to(Y.dtype.element_ty), mask=m)


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The kernel (needs Triton; on the CPU only under TRITON_INTERPRET=1) over x's last dimension."""
    assert triton is not None
    cols = x.shape[-1]
    y = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    x3 = _rows_view(x)
    rows = x3.shape[0] * x3.shape[1]
    block = triton.next_power_of_2(cols)
    per = max(1, min(16, 4096 // block))  # rows a program: 4 for 1,024 columns, 16 for a head's 128
    _rms_kernel[(triton.cdiv(rows, per),)](
        x3, weight, y, rows, x3.shape[1], x3.stride(0), x3.stride(1), cols, eps,
        ROWS=per, BLOCK=block, num_warps=4,
    )  # fmt: skip
    return y


def _rows_view(x: torch.Tensor) -> torch.Tensor:
    """x as [outer, inner, cols] with its last dimension contiguous, without a copy where its strides
    allow (a head view [..., heads, head_dim] of a slice of a wider projection does), else a copy."""
    cols = x.shape[-1]
    inner = x.shape[-2] if x.dim() >= 2 else 1
    if x.stride(-1) == 1 or cols == 1:
        try:
            return x.view(-1, inner, cols)
        except RuntimeError:  # the leading dimensions do not merge into one stride
            pass
    return x.contiguous().view(-1, inner, cols)


@torch.library.custom_op("gyre::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm over x's last dimension (see the module docstring): one Triton kernel where it runs,
    else `reference_rms_norm`."""
    if available(x.device) and x.shape[-1] <= 8192 and x.numel() > 0:
        return triton_rms_norm(x, weight, eps)
    return reference_rms_norm(x, weight, eps)


@rms_norm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype))


class FusedRMSNorm(nn.Module):
    """A replaced module's forward: the op over its own `weight` and `variance_epsilon`."""

    weight: nn.Parameter
    variance_epsilon: float

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, float(self.variance_epsilon))


def fuse_rms_norms(model: nn.Module) -> int:
    """Give every module of a class in `NORM_CLASSES` the fused forward (its class becomes a subclass of
    its own and `FusedRMSNorm`, so isinstance checks still hold); returns how many."""
    made: dict[type, type] = {}
    n = 0
    for mod in model.modules():
        cls = type(mod)
        if cls.__name__ not in NORM_CLASSES or not _fusable(mod):
            continue
        if cls not in made:
            made[cls] = type(f"Fused{cls.__name__}", (FusedRMSNorm, cls), {})
        mod.__class__ = made[cls]
        n += 1
    log.info("fused %d RMS norms", n)
    return n


def _fusable(mod: Any) -> bool:
    w = getattr(mod, "weight", None)
    return isinstance(w, torch.Tensor) and w.dim() == 1 and hasattr(mod, "variance_epsilon")
