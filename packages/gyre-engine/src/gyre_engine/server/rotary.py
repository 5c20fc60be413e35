"""The rotary position embedding of a layer's queries and keys as one Triton kernel on CUDA, where
transformers' `apply_rotary_pos_emb` runs ten (for the query and for the key: a product with the cosines,
a negation and a concatenation for `rotate_half`, a product with the sines, a sum).

Why: after the fused RMS norms (`norms.py`) a decode step of the Qwen3-0.6B shape still launches about
860 kernels, most of them elementwise kernels of a few rows that cost the GPU a few microseconds each
whatever their size; the rotary embedding is about 280 of them (ten a layer). One kernel a layer would
remove about 250 (counted from transformers' code; the kernel's speed is not measured yet).

The kernel computes what transformers computes, rounding where it rounds: each product (x * cos,
rotate_half(x) * sin) is rounded to the output's dtype, then their sum is. In bfloat16 and float16 (the
engine's dtypes on a GPU) the result is then transformers' bit for bit (checked in Triton's interpreter
in float16 and float32; its bfloat16 differs there only because the interpreter rounds bfloat16 its own
way), so the sampled tokens' log-probabilities the trainer recomputes do not move; in float32 on a GPU
the compiler may fuse a product and the sum (one rounding fewer).

How it is installed: the model's attention modules call the module-level `apply_rotary_pos_emb` of their
modeling file (`transformers.models.qwen3.modeling_qwen3`, ...). `fuse_rotary` replaces that function in
each such file with `fused(function)`, after checking on a small input that the file's own
function computes the formula here. The replacement runs the kernel only where it computes the same
thing (CUDA or Triton's interpreter, no input that needs a gradient, the usual call) and the original
function otherwise, so the replacement is process-wide but changes no result: a model trained in the
same process still gets transformers' function (its inputs need gradients). The engine installs it with
`Engine.Config.fuse_rotary`, off until the kernel's CUDA test (`tests/test_rotary_cuda.py`) has run on a
GPU, which it has not yet.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
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

NAME = "apply_rotary_pos_emb"
"""The module-level function of a transformers modeling file that `fuse_rotary` replaces."""


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def reference_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' `apply_rotary_pos_emb` (Llama, Qwen2/3, Mistral): q/k [B, heads, T, D], cos/sin
    [B, T, D] (unsqueezed at `unsqueeze_dim` to broadcast over the heads)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin)


if triton is not None:

    @triton.jit
    def _rotate_heads(  # type: ignore[no-untyped-def]
        X, Y, base_x, base_y, sx_h, sy_h, heads, c1, c2, s1, s2,
        HALF: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr,
    ):  # fmt: skip
        h = tl.arange(0, BH)
        d = tl.arange(0, BD)
        m = (h[:, None] < heads) & (d[None, :] < HALF)
        at = base_x + h[:, None] * sx_h + d[None, :]
        x1 = tl.load(X + at, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(X + at + HALF, mask=m, other=0.0).to(tl.float32)
        ty = Y.dtype.element_ty
        # as transformers rounds: x * cos and rotate_half(x) * sin each to the output's dtype, then the sum
        a1 = (x1 * c1[None, :]).to(ty).to(tl.float32)
        b1 = (-x2 * s1[None, :]).to(ty).to(tl.float32)
        a2 = (x2 * c2[None, :]).to(ty).to(tl.float32)
        b2 = (x1 * s2[None, :]).to(ty).to(tl.float32)
        to = base_y + h[:, None] * sy_h + d[None, :]
        tl.store(Y + to, (a1 + b1).to(ty), mask=m)
        tl.store(Y + to + HALF, (a2 + b2).to(ty), mask=m)

    @triton.jit
    def _rotary_kernel(  # type: ignore[no-untyped-def]
        Q, K, C, S, QO, KO, T, HQ, HK,
        sq_b, sq_h, sq_t, sk_b, sk_h, sk_t,
        sc_b, sc_t, ss_b, ss_t,
        sqo_b, sqo_h, sqo_t, sko_b, sko_h, sko_t,
        HALF: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr,
    ):  # fmt: skip
        # one program a token (b, t): its cosines and sines read once for all its query and key heads
        tok = tl.program_id(0).to(tl.int64)
        b = tok // T
        t = tok % T
        d = tl.arange(0, BD)
        dm = d < HALF
        c1 = tl.load(C + b * sc_b + t * sc_t + d, mask=dm, other=0.0).to(tl.float32)
        c2 = tl.load(C + b * sc_b + t * sc_t + HALF + d, mask=dm, other=0.0).to(tl.float32)
        s1 = tl.load(S + b * ss_b + t * ss_t + d, mask=dm, other=0.0).to(tl.float32)
        s2 = tl.load(S + b * ss_b + t * ss_t + HALF + d, mask=dm, other=0.0).to(tl.float32)
        _rotate_heads(
            Q, QO, b * sq_b + t * sq_t, b * sqo_b + t * sqo_t, sq_h, sqo_h, HQ, c1, c2, s1, s2,
            HALF=HALF, BH=BH, BD=BD,
        )  # fmt: skip
        _rotate_heads(
            K, KO, b * sk_b + t * sk_t, b * sko_b + t * sko_t, sk_h, sko_h, HK, c1, c2, s1, s2,
            HALF=HALF, BH=BH, BD=BD,
        )  # fmt: skip


def triton_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel (needs Triton; on the CPU only under TRITON_INTERPRET=1): q [B, HQ, T, D], k [B, HK, T,
    D], cos/sin [B or 1, T, D], each with its last dimension contiguous (see `_fits`). The outputs keep
    q's and k's layouts, as torch's elementwise ops do."""
    assert triton is not None
    b, hq, t, d = q.shape
    hk = k.shape[1]
    dt = torch.promote_types(q.dtype, cos.dtype)
    qo = torch.empty_like(q, dtype=dt)
    ko = torch.empty_like(k, dtype=torch.promote_types(k.dtype, cos.dtype))
    cos, sin = cos.expand(b, t, d), sin.expand(b, t, d)
    _rotary_kernel[(b * t,)](
        q, k, cos, sin, qo, ko, t, hq, hk,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1), ko.stride(2),
        HALF=d // 2, BH=triton.next_power_of_2(max(hq, hk)), BD=triton.next_power_of_2(d // 2),
        num_warps=4 if d * max(hq, hk) >= 2048 else 2,
    )  # fmt: skip
    return qo, ko


@torch.library.custom_op("gyre::rotary", mutates_args=())
def rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary embedding of q and k (`reference_rotary` with `unsqueeze_dim` 1): one Triton kernel
    where it runs and the inputs fit it, else the reference."""
    if available(q.device) and _fits(q, k, cos, sin):
        return triton_rotary(q, k, cos, sin)
    return reference_rotary(q, k, cos, sin)


@rotary.register_fake
def _(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.empty_like(q, dtype=torch.promote_types(q.dtype, cos.dtype)),
        torch.empty_like(k, dtype=torch.promote_types(k.dtype, cos.dtype)),
    )


def _fits(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """The kernel's case: 4-d q/k of one batch and length with an even head dimension, cos/sin [B or 1,
    T, D] alike, every last dimension contiguous, all on one device, dtypes the kernel rounds as torch."""
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
        return False
    b, _, t, d = q.shape
    if (
        d % 2
        or k.shape[0] != b
        or k.shape[2:] != (t, d)
        or cos.shape[1:] != (t, d)
        or cos.shape[0] not in (1, b)
    ):
        return False
    if any(x.stride(-1) != 1 or x.device != q.device for x in (k, cos, sin)) or q.stride(-1) != 1:
        return False
    floats = (torch.float32, torch.bfloat16, torch.float16)
    return all(x.dtype in floats for x in (q, k, cos, sin)) and q.numel() > 0 and k.numel() > 0


def fused(original: Callable[..., Any]) -> Callable[..., Any]:
    """What `fuse_rotary` puts in place of a modeling file's `apply_rotary_pos_emb` (`original`): the
    kernel for the usual call (no more arguments, or `unsqueeze_dim=1`) where it runs and nothing needs a
    gradient, else `original`; after the kernel once raised (a Triton that cannot build it for this GPU),
    `original` always, with the error logged."""

    failed: list[BaseException] = []

    def apply_rotary_pos_emb(
        q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Any:
        if (
            not failed
            and not args
            and kwargs.get("unsqueeze_dim", 1) == 1
            and set(kwargs) <= {"unsqueeze_dim"}
            and available(q.device)
            and not (torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, cos, sin)))
            and _fits(q, k, cos, sin)
        ):
            try:
                return rotary(q, k, cos, sin)
            except Exception as exc:  # the kernel did not build or launch here: transformers' from now on
                failed.append(exc)
                log.error("the rotary kernel failed (%r); transformers' function from now on", exc)
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb.gyre_original = original  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def _computes_the_formula(fn: Callable[..., Any]) -> bool:
    """Whether `fn(q, k, cos, sin)` equals `reference_rotary` on a small float32 input."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 3, 8, generator=g), torch.randn(2, 2, 3, 8, generator=g)
    cos, sin = torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 8, generator=g)
    try:
        got = fn(q, k, cos, sin)
    except Exception:  # another signature
        return False
    want = reference_rotary(q, k, cos, sin)
    return (
        isinstance(got, tuple)
        and len(got) == 2
        and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    )


def fuse_rotary(model: nn.Module) -> list[str]:
    """Replace `apply_rotary_pos_emb` in the modeling file of each attention module of `model` (a module
    with `q_proj` and `k_proj`) whose own function computes `reference_rotary`; returns the files' module
    names (already replaced ones included). Idempotent."""
    done: list[str] = []
    for mod in model.modules():
        if not (hasattr(mod, "q_proj") and hasattr(mod, "k_proj")):
            continue
        name = type(mod).__module__
        if name in done:
            continue
        file = sys.modules.get(name)
        fn = getattr(file, NAME, None)
        if file is None or fn is None:
            continue
        if not hasattr(fn, "gyre_original"):  # not replaced yet
            if not _computes_the_formula(fn):
                log.info("%s.%s is not the usual rotary embedding: left as it is", name, NAME)
                continue
            setattr(file, NAME, fused(fn))
        done.append(name)
    if done:
        log.info("rotary embedding as one kernel in %s", ", ".join(done))
    return done
