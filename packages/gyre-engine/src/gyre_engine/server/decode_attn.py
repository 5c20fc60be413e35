"""Decode attention over the slot KV buffer: one query token per row, grouped-query heads, each row
reading only its own valid columns; in the slot step the same kernel also writes the step's own key and
value into the buffer.

Why gyre has its own kernel here: on the H200 (torch 2.11, `bench/kernels_b64.py`, batch 64 rows of
192-384 tokens, Qwen3-0.6B heads) the attention one decode step needs per layer took 57 µs as a masked
matmul/softmax/matmul over the length bucket, 61 µs with the flash-attention varlen kernel torch ships
(`seqused_k`) and 42 µs with SDPA and a boolean mask, for 77 MB of keys and values; this kernel takes
28-29 µs (with the write). Torch 2.11 has no paged or split-KV entry to flash attention (`block_table`,
`num_splits` came later), and 28 layers of attention cost about as much as a step's weights.

The kernel is flash decoding in Triton: the columns of each (row, KV head) are split into chunks read by
separate programs (enough of them that a step launches about `TARGET_PROGRAMS` programs: at batch 64
with 8 KV heads that is one chunk per row), each program computes the softmax-weighted sum of its chunk
for all the query heads of its KV group at once (the group is padded to 16 rows for the tensor-core dot)
and keeps a running max and sum; with several chunks a second kernel combines them by their
log-sum-exp, with one the program writes the output itself. Tiles past a row's length are not visited.
`MAX_CHUNK_TILES` can also bound the tiles one program walks; it is off: on one H100 with 16 full-width
slots of 12,288 columns, every row taken at lengths uniform over the width, the kernel read the rows'
keys and values at 2.90 TB/s (86% of the memory's speed) with the 4 chunks the target gives, and at
2.80, 2.80, 2.74 and 2.62 TB/s with chunks of at most 4, 8, 16 and 32 tiles; 6 long slots of 33,280
columns ran at 2.30 TB/s, 2.52-2.61 bounded (`bench/agentic_load.py --sweep`).
The slot step's op `gyre::slot_decode_attention` hands over the step's new key/value: the tiles never
read that column from the buffer (a select inside a tile stops Triton from streaming the tiles into shared
memory: that first version took 38-42 µs in the microbenchmark above, against 29 µs now), the
program whose chunk holds it adds it to its running softmax after its tiles and stores it into the
buffer. That replaces the stack and indexed write per layer the step used to run before attention. The op
is opaque to torch.compile (it declares that it mutates the buffer, so the write stays in place) and
capturable in a CUDA graph; off CUDA, or without Triton, it computes the same with torch ops (what the
CPU tests run), and `tests/test_decode_attn.py` checks the Triton kernels on the CPU through Triton's
interpreter. The same kernel with its query rows mapped to slots (several rows reading one slot) is the
attention of a short prefill replayed as a graph, `gyre::slot_prefill_attention` (`slot_prefill.py`).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

try:  # Triton comes with torch's CUDA builds; without it the op falls back to torch matmuls
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

BLOCK_N = 64
"""Columns per tile inside a chunk."""
TARGET_PROGRAMS = 512
"""Chunks are made small enough that a step launches about this many programs (the H200 has 132 SMs).
At batch 64 with 8 KV heads that is one chunk per row (no combine kernel) up to long contexts."""
MAX_CHUNK_TILES = 0
"""Tiles one program walks at most (0: no bound; the chunks follow `TARGET_PROGRAMS` alone). Bounding
them gained nothing on full-width decode slots (module docstring)."""


def masked_reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor, scale: float
) -> torch.Tensor:
    """query [B, H, D], key/value [B, KVH, L, D] (strided views), valid [B] (columns [0, valid[i]) of
    row i are attended); returns [B, H, D] in the query's dtype. Grouped-query attention without
    repeating the KV heads; head j of KV group k is query head k * G + j (transformers' repeat_kv)."""
    b, h, d = query.shape
    kvh, width = key.shape[1], key.shape[2]
    cols = torch.arange(width, device=query.device)
    mask = (cols[None, :] < valid[:, None].to(cols.dtype))[:, None, None, :]
    qg = query.reshape(b, kvh, h // kvh, d)
    scores = torch.matmul(qg, key.transpose(-1, -2))  # [B, KVH, G, L]
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    return torch.matmul(probs, value).reshape(b, h, d)


if triton is not None:

    @triton.jit
    def _split_kernel(  # type: ignore[no-untyped-def]
        Q, K, V, VALID, PART, LSE, KNEW, VNEW, OUT, SLOT,
        sq_b, sq_h,
        sk_b, sk_h, sk_n,
        sv_b, sv_h, sv_n,
        so_b, so_h, so_s,
        sl_b, sl_h,
        skn_b, skn_h, svn_b, svn_h,
        sout_b, sout_h,
        scale_log2,
        G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr, BN: tl.constexpr,
        PREC: tl.constexpr, NEW: tl.constexpr, ONE: tl.constexpr, MAPPED: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0).to(tl.int64)  # 64-bit offsets: slots x capacity x heads can pass 2**31
        kh = tl.program_id(1).to(tl.int64)
        s = tl.program_id(2).to(tl.int64)
        n = tl.load(VALID + b).to(tl.int32)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        gm = g < G
        heads = kh * G + g
        q = tl.load(Q + b * sq_b + heads[:, None] * sq_h + d[None, :], mask=gm[:, None], other=0.0)
        m_i = tl.full([GP], -float("inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        start = s * CHUNK
        if MAPPED:  # query row b reads the KV of slot SLOT[b] (several rows may read one slot)
            sb = tl.load(SLOT + b).to(tl.int64)
        else:
            sb = b
        kbase = K + sb * sk_b + kh * sk_h
        vbase = V + sb * sv_b + kh * sv_h
        # with NEW, column n - 1 is the step's own key/value (KNEW/VNEW): the tiles never read it from the
        # buffer (a select inside a tile would stop Triton from streaming tiles straight into shared
        # memory); the program whose chunk holds it adds it to the running softmax after its tiles and
        # writes it into the buffer
        last = n - 1 if NEW else n
        end = tl.minimum(start + CHUNK, last)  # tiles past the row's end are not visited
        for lo in range(start, end, BN):
            cols = lo + tl.arange(0, BN)
            cm = cols < last
            k = tl.load(kbase + cols[:, None] * sk_n + d[None, :], mask=cm[:, None], other=0.0)
            sc = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2  # [GP, BN], log2 units
            sc = tl.where(cm[None, :], sc, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(sc - m_safe[:, None])
            v = tl.load(vbase + cols[:, None] * sv_n + d[None, :], mask=cm[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
        if NEW:
            own = (start <= n - 1) & (n - 1 < start + CHUNK)
            knew = tl.load(KNEW + b * skn_b + kh * skn_h + d)
            vnew = tl.load(VNEW + b * svn_b + kh * svn_h + d)
            sn = tl.sum(q.to(tl.float32) * knew.to(tl.float32)[None, :], 1) * scale_log2  # [GP]
            sn = tl.where(own, sn, -float("inf"))
            m_new = tl.maximum(m_i, sn)
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(sn - m_safe)
            acc = acc * alpha[:, None] + p[:, None] * vnew.to(tl.float32)[None, :]
            l_i = l_i * alpha + p
            m_i = m_new
            if own:
                tl.store(kbase + (n - 1) * sk_n + d, knew)
                tl.store(vbase + (n - 1) * sv_n + d, vnew)
        has = l_i > 0.0
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        if ONE:  # one chunk covers the row: this is the output (no combine kernel)
            optr = OUT + b * sout_b + heads[:, None] * sout_h + d[None, :]
            tl.store(optr, out.to(OUT.dtype.element_ty), mask=gm[:, None])
        else:
            lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), -float("inf"))
            pptr = PART + b * so_b + heads[:, None] * so_h + s * so_s + d[None, :]
            tl.store(pptr, out, mask=gm[:, None])
            tl.store(LSE + b * sl_b + heads * sl_h + s, lse, mask=gm)

    @triton.jit
    def _combine_kernel(  # type: ignore[no-untyped-def]
        PART, LSE, OUT,
        so_b, so_h, so_s,
        sl_b, sl_h,
        sout_b, sout_h,
        S, SP: tl.constexpr, D: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        sp = tl.arange(0, SP)
        d = tl.arange(0, D)
        sm = sp < S
        lse = tl.load(LSE + b * sl_b + h * sl_h + sp, mask=sm, other=-float("inf"))
        mx = tl.max(lse, 0)
        w = tl.exp2(lse - mx)
        w = tl.where(sm & (lse > -float("inf")), w, 0.0)
        o = tl.load(PART + b * so_b + h * so_h + sp[:, None] * so_s + d[None, :], mask=sm[:, None], other=0.0)
        den = tl.sum(w, 0)  # 0 only for a hole (valid 0: no column attended), whose output is then 0
        out = tl.sum(o * w[:, None], 0) / tl.where(den > 0.0, den, 1.0)
        tl.store(OUT + b * sout_b + h * sout_h + d, out.to(OUT.dtype.element_ty))


def plan_splits(
    batch: int,
    kv_heads: int,
    width: int,
    block_n: int = BLOCK_N,
    target: int = TARGET_PROGRAMS,
    max_tiles: int | None = None,
) -> tuple[int, int]:
    """(splits, chunk) for a step of `batch` rows over `width` columns: chunks of whole tiles of
    `block_n` columns, enough of them that about `target` programs run and none longer than `max_tiles`
    tiles (default `MAX_CHUNK_TILES`; 0: no bound)."""
    cap = MAX_CHUNK_TILES if max_tiles is None else max_tiles
    tiles = max(1, math.ceil(width / block_n))
    want = max(1, math.ceil(target / max(1, batch * kv_heads)))
    if cap > 0:
        want = max(want, math.ceil(tiles / cap))
    splits = min(tiles, want)
    chunk = math.ceil(tiles / splits) * block_n
    return math.ceil(width / chunk), chunk


def triton_decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
    block_n: int = BLOCK_N,
    target: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    new_key: torch.Tensor | None = None,
    new_value: torch.Tensor | None = None,
    max_tiles: int | None = None,
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per row on Triton (needs Triton; on the CPU only under
    TRITON_INTERPRET=1): query [B, H, D], key/value [B, KVH, L, D] (strided views of the slot buffer,
    head dimension contiguous), valid [B] integer (row i attends columns [0, valid[i])); returns
    [B, H, D].
    With `new_key`/`new_value` ([B, KVH, D]), column valid[i] - 1 of row i is the step's own key/value:
    the kernel attends to them and writes them into `key`/`value` (views of the slot buffer).
    With `slots` ([B] integer), key/value are [S, KVH, L, D] and row i reads slot `slots[i]` (the
    queries of a prefill, several of one slot: `slot_prefill_attention`; no new key/value then).
    `max_tiles` bounds the tiles one program walks (default `MAX_CHUNK_TILES`)."""
    assert triton is not None
    b, h, d = query.shape
    kvh, width = key.shape[1], key.shape[2]
    if slots is not None and new_key is not None:
        raise ValueError("mapped rows (slots) take no new key/value")
    g = h // kvh
    if query.stride(2) != 1 or key.stride(3) != 1 or value.stride(3) != 1:
        raise ValueError("decode attention needs the head dimension contiguous")
    if d & (d - 1):
        raise ValueError(f"decode attention needs a power-of-two head dimension, not {d}")
    if (new_key is None) != (new_value is None):
        raise ValueError("give both the new key and the new value, or neither")
    new = new_key is not None and new_value is not None
    if new_key is not None and new_value is not None:
        if new_key.stride(2) != 1 or new_value.stride(2) != 1:
            raise ValueError("the new key and value need the head dimension contiguous")
        kn, vn = new_key.to(key.dtype), new_value.to(value.dtype)
    else:
        kn, vn = key, value  # not read
    splits, chunk = plan_splits(
        b, kvh, width, block_n, TARGET_PROGRAMS if target is None else target, max_tiles
    )
    out = torch.empty((b, h, d), dtype=query.dtype, device=query.device)
    if splits == 1:  # the split kernel writes the output itself
        part, lse = out, out
    else:
        part = torch.empty((b, h, splits, d), dtype=torch.float32, device=query.device)
        lse = torch.empty((b, h, splits), dtype=torch.float32, device=query.device)
    _split_kernel[(b, kvh, splits)](
        query, key, value, valid, part, lse, kn, vn, out, valid if slots is None else slots,
        query.stride(0), query.stride(1),
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        part.stride(0), part.stride(1), part.stride(2) if splits > 1 else 0,
        lse.stride(0), lse.stride(1),
        kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1),
        out.stride(0), out.stride(1),
        scale * 1.4426950408889634,
        G=g, GP=max(16, triton.next_power_of_2(g)), D=d, CHUNK=chunk, BN=block_n,
        PREC="ieee" if query.dtype == torch.float32 else "tf32",  # float32 stays float32 (no TF32)
        NEW=new, ONE=splits == 1, MAPPED=slots is not None,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if splits > 1:
        _combine_kernel[(b, h)](
            part, lse, out,
            part.stride(0), part.stride(1), part.stride(2),
            lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            splits, SP=max(2, triton.next_power_of_2(splits)), D=d,
            num_warps=4,
        )  # fmt: skip
    return out


def triton_available(device: torch.device) -> bool:
    """Whether gyre's Triton kernels (decode attention, RMS norm, rotary embedding) run for tensors on
    `device`: CUDA, or the CPU under Triton's interpreter (TRITON_INTERPRET=1, as the tests run them)."""
    if triton is None:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


@torch.library.custom_op("gyre::slot_decode_attention", mutates_args=("kv",))
def slot_decode_attention(
    query: torch.Tensor,
    new_key: torch.Tensor,
    new_value: torch.Tensor,
    kv: torch.Tensor,
    layer: int,
    valid: torch.Tensor,
    width: int,
    scale: float,
) -> torch.Tensor:
    """One decode step's attention for rows 0..B-1 of the slot buffer `kv` ([2, layers, slots, KVH,
    capacity, D]) at layer `layer`: row i's new key/value (new_key/new_value [B, KVH, D]) go to column
    valid[i] - 1 of its slot, and its query [B, H, D] attends columns [0, valid[i]) of the first `width`.
    A row with valid[i] = 0 is a hole (a long slot that is free, prefilling or held by the prefix cache):
    nothing of its slot is written and its output is finite but meaningless (the Triton kernels read no
    column and give 0; finite, so that the head's token for the row stays inside the vocabulary).
    On CUDA one Triton kernel does both (the write costs no kernel of its own); else (or for a head
    dimension that is not a power of two) an indexed write, then `masked_reference`. Declared as mutating `kv`, so torch.compile keeps the write in place."""
    b, d = query.shape[0], query.shape[-1]
    key, value = kv[0, layer, :b, :, :width], kv[1, layer, :b, :, :width]
    if triton_available(query.device) and not d & (d - 1):  # the kernel tiles a power-of-two head dim
        return triton_decode_attention(query, key, value, valid, scale, new_key=new_key, new_value=new_value)
    rows = torch.arange(b, device=query.device)
    col = (valid - 1).clamp(min=0)
    new = torch.stack([new_key, new_value], dim=1).to(kv.dtype)  # [B, 2, KVH, D]
    kv[:, layer, rows, :, col] = torch.where(
        (valid > 0)[:, None, None, None], new, kv[:, layer, rows, :, col]
    )
    return masked_reference(query, key, value, valid.clamp(min=1), scale)


@slot_decode_attention.register_fake
def _(
    query: Any, new_key: Any, new_value: Any, kv: Any, layer: int, valid: Any, width: int, scale: float
) -> Any:
    return torch.empty_like(query, memory_format=torch.contiguous_format)


@torch.library.custom_op("gyre::slot_prefill_attention", mutates_args=("kv",))
def slot_prefill_attention(
    query: torch.Tensor,
    new_key: torch.Tensor,
    new_value: torch.Tensor,
    kv: torch.Tensor,
    layer: int,
    slot: torch.Tensor,
    valid: torch.Tensor,
    width: int,
    scale: float,
) -> torch.Tensor:
    """A packed prefill's attention over the slot buffer `kv` ([2, layers, slots, KVH, capacity, D]) at
    layer `layer`, one query token per row: token t (query [T, H, D], new_key/new_value [T, KVH, D])
    belongs to slot `slot[t]` at column `valid[t] - 1`; its key/value are written there, then it attends
    columns [0, valid[t]) of its slot (its cached prefix, the tokens of its call before it, itself: the
    causal mask of a prefill on top of a cache). A token with valid[t] = 0 is padding: it writes into the
    last column of its slot (which no prefilled token reaches: a row needs one free column to decode) and
    its output is finite but meaningless. Every write lands before any token attends, so the tokens of
    one call see each other. Shapes and addresses do not depend on the values of `slot` and `valid`, so
    one CUDA graph serves every packing of the same token count (`slot_prefill.py`). On CUDA the
    attention is the decode kernel with rows mapped to slots; else gathered slots and
    `masked_reference`."""
    cols = torch.where(valid > 0, valid - 1, kv.shape[4] - 1)
    keys, values = kv[0, layer].permute(0, 2, 1, 3), kv[1, layer].permute(0, 2, 1, 3)  # [S, cap, KVH, D]
    keys.index_put_((slot, cols), new_key.to(kv.dtype))
    values.index_put_((slot, cols), new_value.to(kv.dtype))
    d = query.shape[-1]
    key, value = kv[0, layer, :, :, :width], kv[1, layer, :, :, :width]
    if triton_available(query.device) and not d & (d - 1):
        return triton_decode_attention(query, key, value, valid, scale, slots=slot)
    return masked_reference(query, key[slot], value[slot], valid.clamp(min=1), scale)


@slot_prefill_attention.register_fake
def _(
    query: Any,
    new_key: Any,
    new_value: Any,
    kv: Any,
    layer: int,
    slot: Any,
    valid: Any,
    width: int,
    scale: float,
) -> Any:
    return torch.empty_like(query, memory_format=torch.contiguous_format)
