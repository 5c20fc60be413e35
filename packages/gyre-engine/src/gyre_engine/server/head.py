"""The decode step's head on CUDA: each row's token and its logprob from the step's logits, in three small
Triton kernels that spread the [B, V] logits over the whole GPU.

What it computes is `sampling.sample` for rows without logit processing or truncation: the float
log-softmax of the logits at the row's temperature (1 for greedy rows), then the argmax (greedy rows) or
the Gumbel-max draw `sampling.pick` makes (sampled rows: the same counter-based noise of (seed, token
index, vocabulary id), the same integer hash, the logarithms through libdevice as torch's CUDA kernels
use them), and the chosen token's logprob. A batch of 64 rows over a 151,936-token vocabulary is 64
reductions of 152k columns; Inductor's fused head gave each row one program, so 64 programs read the
19 MB of logits, in three kernels that took 72 µs a step on the H200 (`bench/profile_b64.py`). Here each
row's vocabulary is cut into chunks read by separate programs:

1. `_chunk_lse`: each chunk's max and sum of exponentials (of logits / temperature);
2. `_chunk_pick`: each program combines its row's chunks into the row's log-sum-exp, then takes the
   argmax of logp (+ noise for sampled rows) over its chunk;
3. `_row_pick`: the best chunk of each row (the first on ties, as `torch.argmax`), its token and logprob.

Rounding differs from torch's log-softmax in the last bits (another summation order), so a token can
differ from the host's only where two candidates are within float rounding of each other; logprobs agree
to ~1e-6. Off CUDA the slot step uses the torch head (but under TRITON_INTERPRET=1 these kernels, which
is how they are tested on the CPU, alone and inside the slot engine).
"""

from __future__ import annotations

import math

import torch

from gyre_engine.server import decode_attn

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None
    libdevice = None

CHUNK = 4096
"""Vocabulary columns per program."""
BLOCK = 1024
"""Columns per tile inside a chunk."""

if triton is not None:

    @triton.jit
    def _mix32(x):  # type: ignore[no-untyped-def]
        # the hash of `sampling._mix32` on int64 values in [0, 2^32)
        x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
        x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
        return (x >> 16) ^ x

    @triton.jit
    def _chunk_lse(  # type: ignore[no-untyped-def]
        X, TEMP, M, L, sx_b, sm_b, V, CH: tl.constexpr, BL: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        c = tl.program_id(1)
        t = tl.load(TEMP + b)
        m = tl.full([], -float("inf"), tl.float32)
        acc = tl.zeros([], tl.float32)
        for off in range(0, CH, BL):
            cols = c * CH + off + tl.arange(0, BL)
            x = tl.load(X + b * sx_b + cols, mask=cols < V, other=-float("inf")).to(tl.float32) / t
            m_new = tl.maximum(m, tl.max(x, 0))
            acc = acc * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
            m = m_new
        tl.store(M + b * sm_b + c, m)
        tl.store(L + b * sm_b + c, acc)

    @triton.jit
    def _chunk_pick(  # type: ignore[no-untyped-def]
        X, TEMP, SAMPLED, SEEDS, POS, M, L, BV, BI, BL_, sx_b, sm_b, V, S,
        CH: tl.constexpr, BL: tl.constexpr, SP: tl.constexpr, LIBDEVICE: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        c = tl.program_id(1)
        sp = tl.arange(0, SP)
        ms = tl.load(M + b * sm_b + sp, mask=sp < S, other=-float("inf"))
        ls = tl.load(L + b * sm_b + sp, mask=sp < S, other=0.0)
        top = tl.max(ms, 0)
        lse = top + tl.log(tl.sum(ls * tl.exp(ms - top), 0))
        t = tl.load(TEMP + b)
        sampled = tl.load(SAMPLED + b) != 0
        seed = tl.load(SEEDS + b).to(tl.int64)
        index = tl.load(POS + b).to(tl.int64) + 1  # the token's index in the sequence
        key = _mix32(_mix32((seed & 0xFFFFFFFF) ^ _mix32(index & 0xFFFFFFFF)) ^ ((seed >> 32) & 0xFFFFFFFF))
        best = tl.full([], -float("inf"), tl.float32)
        best_i = tl.zeros([], tl.int32)
        best_lp = tl.full([], -float("inf"), tl.float32)
        for off in range(0, CH, BL):
            cols = c * CH + off + tl.arange(0, BL)
            cm = cols < V
            logp = tl.load(X + b * sx_b + cols, mask=cm, other=-float("inf")).to(tl.float32) / t - lse
            y = logp
            if sampled:
                h = _mix32(key ^ ((cols.to(tl.int64) * 0x9E3779B1) & 0xFFFFFFFF))
                u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
                if LIBDEVICE:
                    y = logp - libdevice.log(-libdevice.log(u))
                else:  # Triton's interpreter has no libdevice log
                    y = logp - tl.log(-tl.log(u))
            y = tl.where(cm, y, -float("inf"))
            tile_best = tl.max(y, 0)
            tile_i = tl.argmax(y, 0)  # first index among ties
            better = tile_best > best  # a later tile wins only when strictly greater
            best_i = tl.where(better, c * CH + off + tile_i, best_i)
            best_lp = tl.where(better, tl.sum(tl.where(tl.arange(0, BL) == tile_i, logp, 0.0), 0), best_lp)
            best = tl.where(better, tile_best, best)
        tl.store(BV + b * sm_b + c, best)
        tl.store(BI + b * sm_b + c, best_i)
        tl.store(BL_ + b * sm_b + c, best_lp)

    @triton.jit
    def _row_pick(  # type: ignore[no-untyped-def]
        BV, BI, BL_, OUT, NEXT, sm_b, so_r, S, SP: tl.constexpr, HAS_NEXT: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        sp = tl.arange(0, SP)
        v = tl.load(BV + b * sm_b + sp, mask=sp < S, other=-float("inf"))
        j = tl.argmax(v, 0)  # the first chunk holding the row's best value
        tok = tl.load(BI + b * sm_b + j)
        tl.store(OUT + b, tok.to(tl.float64))
        tl.store(OUT + so_r + b, tl.load(BL_ + b * sm_b + j).to(tl.float64))
        if HAS_NEXT:
            tl.store(NEXT + b, tok)


def available(device: torch.device) -> bool:
    """Whether the slot step's head runs these kernels for tensors on `device`: CUDA with Triton (and
    the CPU under TRITON_INTERPRET=1, which is how the tests run them inside the engine)."""
    return decode_attn.triton_available(device)


def decode_head(
    logits: torch.Tensor,
    temps: torch.Tensor,
    sampled: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    out: torch.Tensor | None = None,
    next_ids: torch.Tensor | None = None,
    chunk: int = CHUNK,
    block: int = BLOCK,
) -> torch.Tensor:
    """Per row of `logits` [B, V] (vocabulary dimension contiguous, any float dtype) at temperature
    `temps` [B] (float32): the token and its logprob, as `out` [2, B] float64 (token id, logprob: one
    read-back carries both; allocated when not given). Rows where `sampled` [B] is nonzero draw with the
    noise of their `seeds` [B] and token index `positions` + 1 [B] (int64); the others take the argmax.
    The tokens are also written to `next_ids` [B] (int64) when given: the next step's inputs."""
    assert triton is not None
    b, v = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("decode_head needs the vocabulary dimension contiguous")
    if chunk % block:
        raise ValueError("the chunk must be a whole number of blocks")
    s = math.ceil(v / chunk)
    sp = max(2, triton.next_power_of_2(s))
    dev = logits.device
    parts = torch.empty((5, b, s), dtype=torch.float32, device=dev)
    m, ls, bv, blp = parts[0], parts[1], parts[2], parts[3]
    bi = parts[4].view(torch.int32)
    if out is None:
        out = torch.empty((2, b), dtype=torch.float64, device=dev)
    if out.shape != (2, b) or out.dtype != torch.float64 or out.stride(1) != 1:
        raise ValueError("out must be a [2, B] float64 tensor with contiguous rows")
    _chunk_lse[(b, s)](logits, temps, m, ls, logits.stride(0), s, v, CH=chunk, BL=block)
    _chunk_pick[(b, s)](
        logits, temps, sampled, seeds, positions, m, ls, bv, bi, blp, logits.stride(0), s, v, s,
        CH=chunk, BL=block, SP=sp, LIBDEVICE=dev.type == "cuda",
    )  # fmt: skip
    nxt = next_ids if next_ids is not None else out
    _row_pick[(b,)](bv, bi, blp, out, nxt, s, out.stride(0), s, SP=sp, HAS_NEXT=next_ids is not None)
    return out
