"""Where a batch-64 decode step's time goes: the engine's CUDA-graph slot path under `torch.profiler`.

Builds the bench's model (Qwen3-0.6B shape, random bf16 weights), runs 64 requests twice to compile and
capture the graphs it needs (runs of `--run-steps` decode steps per replay, as `decode_b64.py`), then
profiles two more: one with 2 new tokens (the prefill of 64 prompts of 128 tokens, placing the rows in
their slots, one decode step) and one with `--new` tokens. Writes `profile_b64.json`: per phase the wall
time, GPU kernel time (the sum of kernel times, graphs included), kernels launched, the top kernels by
GPU time and the top host ops; plus the profiler's tables as text. On a CPU it runs the same engine
without graphs (for checking the script only).

    PYTHONPATH=packages/gyre-engine/src python packages/gyre-engine/bench/profile_b64.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

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
    ap.add_argument("--run-steps", type=int, default=8)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    model = make_model(args.shape, "bfloat16" if cuda else "float32", dev)
    rng = random.Random(0)

    def prompts() -> list[list[int]]:
        return [[rng.randrange(1, model.config.vocab_size) for _ in range(128)] for _ in range(args.batch)]

    cfg = Engine.Config(
        max_running_requests=args.batch,
        prefill_chunk=16384,
        decode_slots="auto",
        compile_decode=True,
        run_steps=args.run_steps,
    )
    eng = Engine(model, None, cfg)
    eng.start()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:  # the engine steps in its own thread
        from torch._C._profiler import _ExperimentalConfig

        extra: dict[str, Any] = {"experimental_config": _ExperimentalConfig(profile_all_threads=True)}
    except (ImportError, TypeError):
        extra = {}

    def phase(new: int) -> tuple[dict[str, Any], Any]:
        s0 = eng.stats()
        with profile(activities=acts, **extra) as prof:
            wall = engine_run(eng, prompts(), new)[0]
            if cuda:
                torch.cuda.synchronize()
        s1 = eng.stats()
        steps = s1.decode_steps - s0.decode_steps
        events = prof.key_averages()
        kernels = [e for e in events if e.device_type.name == "CUDA" and _dev_us(e) > 0]
        cpu_ops = sorted(
            (e for e in events if e.device_type.name == "CPU"), key=lambda e: -e.self_cpu_time_total
        )[:20]
        return {
            "new_tokens": new,
            "wall_s": wall,
            "decode_steps": steps,
            "decode_s": s1.decode_time_s - s0.decode_time_s,
            "prefill_s": s1.prefill_time_s - s0.prefill_time_s,
            "gpu_kernel_s": sum(_dev_us(e) for e in kernels) / 1e6,
            "kernels": sum(e.count for e in kernels),
            "top_kernels": [
                {
                    "name": e.key[:140],
                    "count": e.count,
                    "us_total": _dev_us(e),
                    "us_each": _dev_us(e) / e.count,
                }
                for e in sorted(kernels, key=lambda e: -_dev_us(e))[:40]
            ],
            "top_host_ops": [
                {"name": e.key[:120], "count": e.count, "self_ms": e.self_cpu_time_total / 1e3}
                for e in cpu_ops
            ],
        }, events

    try:
        t0 = time.perf_counter()
        engine_run(eng, prompts(), args.new)  # compile, capture the buckets this work needs
        engine_run(eng, prompts(), args.new)
        warm_s = time.perf_counter() - t0
        prefill, _ = phase(2)
        decode, events = phase(args.new)
        more = max(decode["decode_steps"] - prefill["decode_steps"], 1)
        result = {
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__,
            "batch": args.batch,
            "run_steps": args.run_steps,
            "warmup_s": warm_s,
            "prefill_phase": prefill,
            "decode_phase": decode,
            # per decode step: the decode phase less the prefill phase (both prefill 64 prompts)
            "decode_gpu_ms_per_step": 1e3 * (decode["gpu_kernel_s"] - prefill["gpu_kernel_s"]) / more,
            "decode_kernels_per_step": (decode["kernels"] - prefill["kernels"]) / more,
            "slot_stats": eng.slot_stats(),
        }
    finally:
        eng.shutdown()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile_b64.json").write_text(json.dumps(result, indent=1) + "\n")
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    (out / "profile_b64_table.txt").write_text(events.table(sort_by=sort, row_limit=60))
    print(
        json.dumps({k: v for k, v in result.items() if not k.endswith("_phase")}),
        json.dumps(
            {
                k: {x: y for x, y in v.items() if not x.startswith("top")}
                for k, v in result.items()
                if k.endswith("_phase")
            }
        ),
        flush=True,
    )


def _dev_us(e: Any) -> float:
    return float(getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0) or 0)


if __name__ == "__main__":
    main()
