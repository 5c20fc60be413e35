"""Where a batch-64 decode step's time goes: the engine's CUDA-graph slot path under `torch.profiler`.

Builds the bench's model (Qwen3-0.6B shape, random bf16 weights), decodes 64 requests once to compile and
capture the graphs it needs, then profiles a second run of 64 requests (128-token prompts, `--new`
tokens). Writes `profile_b64.json`: wall time per decode step, GPU kernel time per step (the sum of
kernel times, graphs included), the host's share, and the top kernels by GPU time; plus the profiler's
tables as text. On a CPU it runs the same engine without graphs (for checking the script only).

    PYTHONPATH=packages/gyre-engine/src python packages/gyre-engine/bench/profile_b64.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from gyre_engine.bench.run import engine_run, make_model
from gyre_engine.server.engine import Engine
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--new", type=int, default=64, help="new tokens per request in the profiled run")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--shape", default="qwen3-0.6b")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    model = make_model(args.shape, "bfloat16" if cuda else "float32", dev)
    rng = random.Random(0)

    def prompts() -> list[list[int]]:
        return [[rng.randrange(1, model.config.vocab_size) for _ in range(128)] for _ in range(args.batch)]

    cfg = Engine.Config(
        max_running_requests=args.batch, prefill_chunk=16384, decode_slots="auto", compile_decode=True
    )
    eng = Engine(model, None, cfg)
    eng.start()
    try:
        t0 = time.perf_counter()
        engine_run(eng, prompts(), args.new)  # compile, capture the buckets this work needs
        warm_s = time.perf_counter() - t0
        engine_run(eng, prompts(), args.new)
        s0 = eng.stats()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        try:  # the engine steps in its own thread
            from torch._C._profiler import _ExperimentalConfig

            extra = {"experimental_config": _ExperimentalConfig(profile_all_threads=True)}
        except (ImportError, TypeError):
            extra = {}
        with profile(activities=acts, **extra) as prof:
            wall = engine_run(eng, prompts(), args.new)[0]
            if cuda:
                torch.cuda.synchronize()
        s1 = eng.stats()
        steps = s1.decode_steps - s0.decode_steps
        events = prof.key_averages()
        dev_attr = (
            "device_time_total"
            if hasattr(torch.autograd.profiler_util.FunctionEventAvg(), "device_time_total")
            else "cuda_time_total"
        )
        kernels = [e for e in events if e.device_type.name == "CUDA" and getattr(e, dev_attr, 0) > 0]
        gpu_us = sum(getattr(e, dev_attr) for e in kernels)
        top = sorted(kernels, key=lambda e: -getattr(e, dev_attr))[:25]
        cpu_ops = sorted(
            (e for e in events if e.device_type.name == "CPU"), key=lambda e: -e.self_cpu_time_total
        )[:15]
        result = {
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__,
            "batch": args.batch,
            "new_tokens": args.new,
            "warmup_s": warm_s,
            "profiled_wall_s": wall,
            "decode_steps": steps,
            "decode_time_s": s1.decode_time_s - s0.decode_time_s,
            "wall_ms_per_step": 1e3 * wall / max(steps, 1),
            "decode_ms_per_step": 1e3 * (s1.decode_time_s - s0.decode_time_s) / max(steps, 1),
            "gpu_kernel_ms_per_step": gpu_us / 1e3 / max(steps, 1),
            "kernels_per_step": sum(e.count for e in kernels) / max(steps, 1),
            "top_kernels": [
                {
                    "name": e.key[:120],
                    "count": e.count,
                    "ms_per_step": getattr(e, dev_attr) / 1e3 / max(steps, 1),
                }
                for e in top
            ],
            "top_host_ops": [
                {
                    "name": e.key[:120],
                    "count": e.count,
                    "self_ms_per_step": e.self_cpu_time_total / 1e3 / max(steps, 1),
                }
                for e in cpu_ops
            ],
            "slot_stats": eng.slot_stats(),
        }
    finally:
        eng.shutdown()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile_b64.json").write_text(json.dumps(result, indent=1) + "\n")
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    (out / "profile_b64_table.txt").write_text(events.table(sort_by=sort, row_limit=60))
    print(json.dumps({k: v for k, v in result.items() if k != "top_kernels"}), flush=True)


if __name__ == "__main__":
    main()
