"""Which attention trains an agent's tree-packed micro-batch fastest on one GPU: SDPA over a dense ancestor
mask, tree attention (`gyre_train.treeattn`: flash attention over the tree's runs) and FlexAttention, on
the Qwen3-0.6B shape (random weights, bf16), with a CUDA profile of where a micro-batch's time goes. On
one H200, from the repository root:

    python packages/gyre-train/bench/tree_attention.py --out $OUT/tree_attention.json

(PYTHONPATH and wheels as for `tp2_cuda.py` in the package README). Two micro-batches of gyre-traj's
synthetic agent executions (compactions, sub-agents, retries), shaped as the report-shaped workload's
(`integration/examples/h200-agentic.toml`: 32k-token budget, 16k-token chunks):
- `chunked`: one execution of about 27k tokens, trained in chunks of 16,384 over the kept keys and values
  (`gyre_train.chunked`), with each kernel: `dense`, `tree`, and with `--flex-chunked` `flex` (its first
  use compiles for minutes);
- `whole`: one of about 12k tokens in one piece: `dense`, `tree`, `flex` (the model's own: compiled at
  its first use).
Per case and kernel (`cases.<case>.<kernel>`): `first_s` (the first micro-batch: compilation and
allocation included), `median_s` of `--repeats` more, `tok_s` (tokens / median), `peak_gib`
(torch.cuda.max_memory_allocated over the repeats), `grad_rel_err` (the largest difference of the
flat gradient from `dense`'s, over `dense`'s largest entry: bf16 rounding, not a different gradient).
`profile.<case>.<kernel>`: the ten CUDA kernels of one micro-batch with the most time, and the share of
all kernel time in attention kernels (names with "attention", "fmha", "flash" or "flex").
`--cpu --tiny` runs the same steps on the CPU with a 4-layer model and small trees (checks the script).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from gyre_train.bench.run import QWEN3_06B
from gyre_train.chunked import chunked_loss_backward
from gyre_train.data import chunked_warmup_microbatch
from gyre_train.model import attention_implementation, attention_kernels, build_model
from gyre_traj.loss import LossConfig, TorchBatch, policy_loss, target_logprobs_entropy
from gyre_traj.pack import PackedBatch
from long_tree import TINY  # the same 4-layer model as the long-tree bench's --tiny

ATTENTION_KERNELS = ("attention", "fmha", "flash", "flex")


def say(msg: str) -> None:
    print(f"[tree_attention {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def microbatch(chunk: int, budget: int, vocab: int, seed: int) -> PackedBatch:
    mb = chunked_warmup_microbatch(seed, chunk, budget)
    if mb is None:
        raise SystemExit(f"no synthetic execution between {chunk} and {budget} tokens")
    adv = np.random.default_rng(seed).standard_normal(mb.advantages.shape).astype(mb.advantages.dtype)
    # one execution's group-relative advantages are 0, and so would every gradient be
    return replace(mb, input_ids=mb.input_ids % vocab, target_ids=mb.target_ids % vocab, advantages=adv)


def gradient(model: Any, b: PackedBatch, kernel: str, chunk: int) -> torch.Tensor:
    """The flat gradient of `b` (on the model's device) computed with `kernel` (chunks of `chunk` tokens;
    0: whole), with the SDPA kernels `micro_gradient` allows."""
    cfg = LossConfig(mode="tis")
    model.zero_grad(set_to_none=True)
    dev = next(model.parameters()).device
    with attention_kernels(dev):
        if kernel == "flex" and chunk == 0:  # gyre-traj's forward over FlexAttention's block mask
            tb = TorchBatch.from_packed(b, device=dev)
            lp, entropy = target_logprobs_entropy(model, tb, attention="flex")
            policy_loss(lp, tb, cfg, entropy)[0].backward()
        else:
            with attention_implementation(model, kernel):  # type: ignore[arg-type]
                chunked_loss_backward(model, b, chunk or b.num_tokens, cfg, kernel)  # type: ignore[arg-type]
    flat = torch.cat([p.grad.reshape(-1).float() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return flat


def sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def measure(model: Any, b: PackedBatch, kernel: str, chunk: int, dev: str, repeats: int) -> dict[str, Any]:
    sync(dev)
    t0 = time.perf_counter()
    g = gradient(model, b, kernel, chunk)
    sync(dev)
    first = time.perf_counter() - t0
    g = g.cpu()  # kept for the comparison with dense's, off the device
    if dev == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        gradient(model, b, kernel, chunk)
        sync(dev)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    out = {"tokens": b.num_tokens, "first_s": round(first, 3), "median_s": round(med, 4),
           "tok_s": round(b.num_tokens / med), "times_s": [round(x, 4) for x in times]}  # fmt: skip
    if dev == "cuda":
        out["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    out["_grad"] = g
    return out


def profile(model: Any, b: PackedBatch, kernel: str, chunk: int, dev: str) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    with torch_profile(activities=acts) as prof:
        gradient(model, b, kernel, chunk)
        sync(dev)
    rows = []
    for e in prof.key_averages():
        t = e.self_device_time_total if dev == "cuda" else e.self_cpu_time_total
        if t > 0 and (dev != "cuda" or e.device_type.name == "CUDA"):
            rows.append((t, e.key, e.count))
    rows.sort(reverse=True)
    total = sum(t for t, _, _ in rows) or 1.0
    attn = sum(t for t, k, _ in rows if any(w in k.lower() for w in ATTENTION_KERNELS))
    return {
        "kernel_s": round(total / 1e6, 4),
        "attention_share": round(attn / total, 3),
        "top": [{"name": k[:120], "s": round(t / 1e6, 4), "calls": n} for t, k, n in rows[:10]],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="tree_attention.json")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--flex-chunked", action="store_true", help="also FlexAttention on the chunked case")
    p.add_argument("--no-profile", action="store_true")
    a = p.parse_args()
    dev = "cpu" if a.cpu else "cuda"
    mc = replace(TINY if a.tiny else QWEN3_06B, dtype="float32" if a.cpu else "bfloat16")
    chunk, budget, whole_budget = (512, 1024, 900) if a.tiny else (16384, 32768, 14000)
    say(f"model {'tiny' if a.tiny else 'Qwen3-0.6B shape'} on {dev}")
    model = build_model(mc, "flex" if dev == "cuda" else "dense", dev)
    cases = {
        "chunked": (microbatch(chunk, budget, mc.vocab_size, 0), chunk),
        "whole": (microbatch(whole_budget // 2, whole_budget, mc.vocab_size, 1), 0),
    }
    kernels = {
        "chunked": ["dense", "tree"] + (["flex"] if a.flex_chunked and dev == "cuda" else []),
        "whole": ["dense", "tree"] + (["flex"] if dev == "cuda" else []),
    }
    res: dict[str, Any] = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                           "torch": torch.__version__, "model": "tiny" if a.tiny else "qwen3-0.6b",
                           "cases": {}, "profile": {}}  # fmt: skip

    def save() -> None:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)

    for case, (b, ch) in cases.items():
        got: dict[str, Any] = {}
        for k in kernels[case]:
            say(f"{case} ({b.num_tokens} tokens, chunks {ch or 'none'}): {k} ...")
            try:
                got[k] = measure(model, b, k, ch, dev, a.repeats)
            except Exception as exc:  # one kernel's failure is a figure too, the others still run
                got[k] = {"error": f"{type(exc).__name__}: {exc}"}
            say(f"  { ({x: y for x, y in got[k].items() if x != '_grad'}) }")
        ref = got.get("dense", {}).get("_grad")
        for r in got.values():
            g = r.pop("_grad", None)
            if ref is not None and g is not None:
                r["grad_rel_err"] = float((g - ref).abs().max() / ref.abs().max())
        res["cases"][case] = got
        save()
        if not a.no_profile:
            res["profile"][case] = {}
            for k in ("dense", "tree"):
                say(f"profile {case} {k} ...")
                res["profile"][case][k] = profile(model, b, k, ch, dev)
                save()
    for case, got in res["cases"].items():
        d, t = got.get("dense", {}).get("median_s"), got.get("tree", {}).get("median_s")
        if d and t:
            res.setdefault("tree_speedup_over_dense", {})[case] = round(d / t, 2)
        f = got.get("flex", {}).get("median_s")
        if f and t:
            res.setdefault("tree_speedup_over_flex", {})[case] = round(f / t, 2)
    save()
    say(f"done: {json.dumps({k: v for k, v in res.items() if k.startswith('tree_')})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
