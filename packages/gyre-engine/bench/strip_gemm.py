"""An experiment kept with its figures: `y = x @ w.T` for decode-sized x (at most 128 rows) as a Triton
kernel that reads each weight element once, tried against cuBLAS for the decode step's projections.

Each program owns a strip of output columns for all rows and streams its strip of the weight over K
(split over several programs when the strips alone would not fill the GPU; a second kernel adds the
partial sums); the rows ride along from L2. On the H200 (`kernels_b64.py --gemms-only`, 64 rows, 28
layers of Qwen3-0.6B weights per shape, `results-h200-kernels.json`) its best configuration per shape
took 5.7 / 6.6 / 6.9 / 8.3 µs per GEMM (q/k/v, o, gate/up, down) against cuBLAS's 5.4 / 5.9 / 6.5 /
8.1 µs: at these sizes a GEMM's time is mostly its fixed cost, not its bytes. Wired into the engine's
decode step it gave 21,753 tokens/s at batch 64 against 23,200 with cuBLAS, so the engine uses cuBLAS.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

MAX_ROWS = 128
TARGET_PROGRAMS = 264
"""About two programs per SM of an H200."""


if triton is not None:

    @triton.jit
    def _strip_kernel(  # type: ignore[no-untyped-def]
        X, W, Y, PART, M, N, K,
        sx_m, sw_n, sy_m, sp_s, sp_m,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr,
        SPLIT: tl.constexpr, PREC: tl.constexpr,
    ):  # fmt: skip
        pn = tl.program_id(0)
        pk = tl.program_id(1)
        rm = tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        mm = rm < M
        nm = rn < N
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, KS, BK):
            rk = pk * KS + k0 + tl.arange(0, BK)
            km = rk < K
            x = tl.load(X + rm[:, None] * sx_m + rk[None, :], mask=mm[:, None] & km[None, :], other=0.0)
            w = tl.load(W + rn[:, None] * sw_n + rk[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            acc += tl.dot(x, tl.trans(w), input_precision=PREC)
        if SPLIT == 1:
            tl.store(
                Y + rm[:, None] * sy_m + rn[None, :],
                acc.to(Y.dtype.element_ty),
                mask=mm[:, None] & nm[None, :],
            )
        else:
            tl.store(PART + pk * sp_s + rm[:, None] * sp_m + rn[None, :], acc, mask=mm[:, None] & nm[None, :])

    @triton.jit
    def _sum_kernel(  # type: ignore[no-untyped-def]
        PART, Y, M, N, sp_s, sp_m, sy_m,
        SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    ):  # fmt: skip
        pn = tl.program_id(0)
        rm = tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        msk = (rm < M)[:, None] & (rn < N)[None, :]
        acc = tl.zeros([BM, BN], tl.float32)
        for s in range(SPLIT):
            acc += tl.load(PART + s * sp_s + rm[:, None] * sp_m + rn[None, :], mask=msk, other=0.0)
        tl.store(Y + rm[:, None] * sy_m + rn[None, :], acc.to(Y.dtype.element_ty), mask=msk)


def plan(m: int, n: int, k: int, target: int = TARGET_PROGRAMS) -> tuple[int, int, int]:
    """(BN, BK, SPLIT) for an [m, k] x [k, n] product: strips of 32 columns (16 for narrow outputs), K
    split until about `target` programs run, each program's share a whole number of BK steps."""
    bn = 32 if n >= 4096 else 16
    bk = 128
    strips = -(-n // bn)
    split = 1
    while strips * split * 2 <= target and k % (bk * split * 2) == 0:
        split *= 2
    return bn, bk, split


def triton_skinny_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    bn: int | None = None,
    bk: int | None = None,
    split: int | None = None,
    num_warps: int = 4,
    num_stages: int = 4,
) -> torch.Tensor:
    """The Triton path of `skinny_linear` (x [..., K] with at most MAX_ROWS rows, w [N, K])."""
    assert triton is not None
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    n = w.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"skinny_linear takes at most {MAX_ROWS} rows, not {m}")
    if w.stride(-1) != 1:
        raise ValueError("skinny_linear needs the weight's rows contiguous")
    pbn, pbk, psplit = plan(m, n, k)
    bn, bk, split = bn or pbn, bk or pbk, split or psplit
    ks = -(-k // split)
    ks = -(-ks // bk) * bk
    bm = max(16, triton.next_power_of_2(m))
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    _strip_kernel[(-(-n // bn), split)](
        x2, w, y, part, m, n, k,
        x2.stride(0), w.stride(0), y.stride(0), part.stride(0) if split > 1 else 0, part.stride(-2),
        BM=bm, BN=bn, BK=bk, KS=ks, SPLIT=split, PREC=prec,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if split > 1:
        _sum_kernel[(-(-n // 64),)](
            part, y, m, n, part.stride(0), part.stride(1), y.stride(0), SPLIT=split, BM=bm, BN=64,
            num_warps=4,
        )  # fmt: skip
    if bias is not None:
        y += bias
    return y.reshape(*shape[:-1], n)
