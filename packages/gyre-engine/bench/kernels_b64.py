"""The pieces of one batch-64 decode step on a GPU, timed alone in CUDA graphs: the projections of 28
Qwen3-0.6B-shaped layers as seven GEMMs per layer against fused q/k/v and gate/up (and with the weights
stored transposed), and decode attention over per-row lengths as gyre's grouped matmul/softmax against
the flash-attention varlen kernel that torch ships (`seqused_k`; paged with a block table where this
torch has one), SDPA, cuDNN and gyre's Triton kernel (with a sweep of its tile sizes), and a Triton strip
GEMM (`strip_gemm.py`) against cuBLAS per projection shape. Each variant's output is checked against a
reference. Device only.

    python packages/gyre-engine/bench/kernels_b64.py --out kernels.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

LAYERS, HID, HEADS, KVH, HD, INTER = 28, 1024, 16, 8, 128, 3072


def timed(fn: Callable[[], Any], reps: int = 30) -> float:
    """Median ms of one replay of a CUDA graph of `fn`."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    out.sort()
    return out[len(out) // 2]


def gemms(m: int) -> dict[str, float]:
    dt, dev = torch.bfloat16, "cuda"
    shapes = {
        "q": (HEADS * HD, HID),
        "k": (KVH * HD, HID),
        "v": (KVH * HD, HID),
        "o": (HID, HEADS * HD),
        "gate": (INTER, HID),
        "up": (INTER, HID),
        "down": (HID, INTER),
    }
    w = [{k: torch.randn(s, dtype=dt, device=dev) * 0.02 for k, s in shapes.items()} for _ in range(LAYERS)]
    fused = [
        {
            "qkv": torch.cat([lw["q"], lw["k"], lw["v"]]),
            "o": lw["o"],
            "gu": torch.cat([lw["gate"], lw["up"]]),
            "down": lw["down"],
        }
        for lw in w
    ]
    fused_t = [{k: v.t().contiguous() for k, v in lw.items()} for lw in fused]
    x = torch.randn(m, HID, dtype=dt, device=dev)
    xa = torch.randn(m, HEADS * HD, dtype=dt, device=dev)
    xi = torch.randn(m, INTER, dtype=dt, device=dev)
    lm = torch.randn(151936, HID, dtype=dt, device=dev) * 0.02

    def sep() -> None:
        for lw in w:
            for k in ("q", "k", "v", "gate", "up"):
                F.linear(x, lw[k])
            F.linear(xa, lw["o"])
            F.linear(xi, lw["down"])

    def four_gemms(layers: list[dict[str, torch.Tensor]], op: Callable[..., Any]) -> Callable[[], None]:
        def run() -> None:
            for lw in layers:
                op(x, lw["qkv"])
                op(xa, lw["o"])
                op(x, lw["gu"])
                op(xi, lw["down"])

        return run

    fus = four_gemms(fused, F.linear)  # weights [N, K]
    fus_t = four_gemms(fused_t, torch.mm)  # the same stored transposed, [K, N]

    wbytes = sum(t.numel() * 2 for lw in w for t in lw.values())
    res = {"m": m, "weight_bytes": wbytes}
    for name, fn in (("seven_gemms", sep), ("fused_qkv_gateup", fus), ("fused_transposed", fus_t)):
        ms = timed(fn)
        res[name + "_ms"] = ms
        res[name + "_tb_s"] = wbytes / ms / 1e9
    res["lm_head_ms"] = timed(lambda: F.linear(x, lm))
    # gyre's Triton strip kernel, per GEMM shape (28 layers of weights each), against cuBLAS
    from strip_gemm import plan, triton_skinny_linear  # beside this script

    per: dict[str, Any] = {}
    for name, xin in (("qkv", x), ("o", xa), ("gu", x), ("down", xi)):
        ws = [lw[name] for lw in fused]
        n, k = ws[0].shape
        nbytes = sum(t.numel() * 2 for t in ws)
        row: dict[str, Any] = {"n": n, "k": k, "plan": plan(m, n, k)}
        row["cublas_us"] = timed(lambda ws=ws, xin=xin: [F.linear(xin, t) for t in ws]) * 1000 / LAYERS
        configs = [(None, None, None, 4)] + [
            (bn, 128, sp, st)
            for bn in (16, 32, 64)
            for sp in (1, 2, 4, 8)
            for st in (3, 4)
            if k % (128 * sp) == 0
        ]
        for bn, bk, sp, st in configs:
            key = "plan" if bn is None else f"bn{bn}_bk{bk}_s{sp}_st{st}"
            try:
                got = triton_skinny_linear(xin, ws[0], None, bn, bk, sp, 4, st)
                err = float((got.float() - F.linear(xin, ws[0]).float()).abs().max())
                us = (
                    timed(
                        lambda ws=ws, xin=xin, bn=bn, bk=bk, sp=sp, st=st: [
                            triton_skinny_linear(xin, t, None, bn, bk, sp, 4, st) for t in ws
                        ]
                    )
                    * 1000
                    / LAYERS
                )
                row[key] = {"us": us, "tb_s": nbytes / LAYERS / us / 1e6, "max_err": err}
            except Exception as exc:
                row[key] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        per[name] = row
    res["strip_kernel"] = per
    return res


def attention(b: int, top: int, sweep: bool = False) -> dict[str, Any]:
    dt, dev = torch.bfloat16, "cuda"
    torch.manual_seed(0)
    cap = 1 << max(9, (top - 1).bit_length())
    lengths = torch.randint(top // 2, top + 1, (b,), device=dev, dtype=torch.int32)
    width = top
    q = torch.randn(b, HEADS, HD, dtype=dt, device=dev)
    # token-major slot layout [slots, cap, kvh, hd] (what flash wants) and head-major [slots, kvh, cap, hd]
    ktm = torch.randn(b, cap, KVH, HD, dtype=dt, device=dev)
    vtm = torch.randn(b, cap, KVH, HD, dtype=dt, device=dev)
    khm, vhm = ktm.transpose(1, 2).contiguous(), vtm.transpose(1, 2).contiguous()
    scale = HD**-0.5
    cols = torch.arange(width, device=dev)
    mask = (cols[None, :] < lengths[:, None].long())[:, None, None, :]

    kf, vf = ktm.float(), vtm.float()
    qg = q.float().view(b, KVH, HEADS // KVH, HD)
    sc = torch.einsum("bkgd,btkd->bkgt", qg, kf[:, :width]) * scale
    sc = sc.masked_fill(~mask, float("-inf"))
    ref = torch.einsum("bkgt,btkd->bkgd", sc.softmax(-1), vf[:, :width]).reshape(b, HEADS, HD)

    kv_bytes = int(lengths.sum().item()) * KVH * HD * 2 * 2
    out: dict[str, Any] = {"batch": b, "max_len": top, "kv_bytes": kv_bytes}

    def grouped() -> torch.Tensor:
        k, v = khm[:, :, :width], vhm[:, :, :width]
        qq = q.view(b, KVH, HEADS // KVH, HD)
        s = torch.matmul(qq, k.transpose(-1, -2)).float() * scale
        s = s.masked_fill(~mask, float("-inf"))
        p = torch.softmax(s, dim=-1).to(dt)
        return torch.matmul(p, v).reshape(b, HEADS, HD)

    def grouped_tm() -> torch.Tensor:  # the same on the token-major layout (strided views)
        k, v = ktm[:, :width].transpose(1, 2), vtm[:, :width].transpose(1, 2)
        qq = q.view(b, KVH, HEADS // KVH, HD)
        s = torch.matmul(qq, k.transpose(-1, -2)).float() * scale
        s = s.masked_fill(~mask, float("-inf"))
        p = torch.softmax(s, dim=-1).to(dt)
        return torch.matmul(p, v).reshape(b, HEADS, HD)

    cu_q = torch.arange(b + 1, device=dev, dtype=torch.int32)
    cu_k_cap = torch.arange(b + 1, device=dev, dtype=torch.int32) * cap
    cu_k_len = torch.zeros(b + 1, device=dev, dtype=torch.int32)
    cu_k_len[1:] = torch.cumsum(lengths, 0)
    table = torch.arange(b, device=dev, dtype=torch.int32)[:, None]

    def flash_seqused() -> torch.Tensor:
        return torch.ops.aten._flash_attention_forward(
            q,
            ktm.view(b * cap, KVH, HD),
            vtm.view(b * cap, KVH, HD),
            cu_q,
            cu_k_cap,
            1,
            width,
            0.0,
            False,
            False,
            scale=scale,
            seqused_k=lengths,
        )[0]

    def flash_paged(splits: int | None) -> Callable[[], torch.Tensor]:
        def f() -> torch.Tensor:
            return torch.ops.aten._flash_attention_forward(
                q,
                ktm,
                vtm,
                cu_q,
                cu_k_len,
                1,
                width,
                0.0,
                False,
                False,
                scale=scale,
                block_table=table,
                num_splits=splits,
            )[0]

        return f

    def sdpa_mask() -> torch.Tensor:
        qq = q[:, :, None, :]
        return F.scaled_dot_product_attention(
            qq, khm[:, :, :width], vhm[:, :, :width], attn_mask=mask, scale=scale, enable_gqa=True
        )[:, :, 0]

    def cudnn_paged() -> torch.Tensor:
        return torch.ops.aten._cudnn_attention_forward(
            q[:, :, None, :],
            ktm.transpose(1, 2),
            vtm.transpose(1, 2),
            None,
            None,
            None,
            1,
            width,
            False,
            scale=scale,
            seqused_k=lengths,
        )[0][:, :, 0]

    from gyre_engine.server.decode_attn import triton_decode_attention

    valid = lengths.long()

    def gyre_triton() -> torch.Tensor:
        return triton_decode_attention(q, khm[:, :, :width], vhm[:, :, :width], valid, scale)

    variants: list[tuple[str, Callable[[], torch.Tensor]]] = [
        ("gyre_triton_flash_decoding", gyre_triton),
        ("grouped_matmul", grouped),
        ("grouped_matmul_token_major", grouped_tm),
        ("flash_varlen_seqused_k", flash_seqused),
        ("flash_paged", flash_paged(None)),
        ("flash_paged_splits4", flash_paged(4)),
        ("flash_paged_splits8", flash_paged(8)),
        ("sdpa_bool_mask_gqa", sdpa_mask),
        ("cudnn_seqused_k", cudnn_paged),
    ]
    # the engine's kernel as the slot step calls it: the step's own key/value handed over (here equal to
    # what the buffer holds at column n - 1, so the reference stands) and written by the kernel; one
    # split per row (no combine kernel) where `target` allows
    rows = torch.arange(b, device=dev)
    new_k = khm[rows, :, lengths.long() - 1]  # [b, kvh, hd]
    new_v = vhm[rows, :, lengths.long() - 1]
    for bn in (64, 128):
        for target in (256, 512, 1024, 2048):
            for warps, stages in ((4, 2), (4, 3), (8, 3)):
                variants.append((
                    f"write_bn{bn}_t{target}_w{warps}_s{stages}",
                    lambda bn=bn, target=target, warps=warps, stages=stages: triton_decode_attention(
                        q, khm[:, :, :width], vhm[:, :, :width], valid, scale, bn, target, warps, stages,
                        new_key=new_k, new_value=new_v,
                    ),
                ))  # fmt: skip
    if sweep:
        for bn in (32, 64, 128):
            for target in (512, 1024, 2048, 4096):
                for warps, stages in ((4, 2), (4, 3), (8, 2)):
                    variants.append((
                        f"triton_bn{bn}_t{target}_w{warps}_s{stages}",
                        lambda bn=bn, target=target, warps=warps, stages=stages: triton_decode_attention(
                            q, khm[:, :, :width], vhm[:, :, :width], valid, scale, bn, target, warps, stages
                        ),
                    ))  # fmt: skip
    for name, fn in variants:
        try:
            got = fn().float().reshape(b, HEADS, HD)
            err = float((got - ref).abs().max())
            ms = timed(fn)
            out[name] = {"ms": ms, "max_err": err, "tb_s": kv_bytes / ms / 1e9}
        except Exception as exc:  # report what this torch lacks, go on with the rest
            out[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--gemms-only", action="store_true")
    ap.add_argument(
        "--attention-only", action="store_true", help="attention variants only, without the old tile sweep"
    )
    args = ap.parse_args()
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "flash_schema": str(torch.ops.aten._flash_attention_forward.default._schema),
    }
    if args.attention_only:
        res["attention"] = [attention(64, top) for top in (384, 1024, 4096)] + [attention(16, 1024)]
        with open(args.out, "w") as f:
            f.write(json.dumps(res, indent=1) + "\n")
        return
    res["gemms"] = [gemms(m) for m in (64, 16)]
    if args.gemms_only:
        with open(args.out, "w") as f:
            f.write(json.dumps(res, indent=1) + "\n")
        return
    print(json.dumps(res["gemms"]), flush=True)
    res["attention"] = [attention(64, top, sweep=True) for top in (384, 1024, 4096)] + [
        attention(16, 1024, sweep=True)
    ]
    print(json.dumps(res["attention"]), flush=True)
    with open(args.out, "w") as f:
        f.write(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
