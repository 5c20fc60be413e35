"""Batch 64 only, on CUDA: the engine's slot/CUDA-graph decode path on 64 prompts (128 tokens each, 256
new tokens), in one process, plus the bandwidth fraction: a warm-up pass at the measured shapes, then the median of `--repeats` passes on fresh prompts. The baseline is
`generate_alone.py`, plain `generate` in a fresh process (in the engine's process it runs slower: see the
README). `--prefill-chunk` defaults to 8192, so the 64 prompts are prefilled in one pass;
`--temperature 1` measures sampled rows (drawn on the device in runs) instead of greedy ones.

    PYTHONPATH=packages/gyre-engine/src python packages/gyre-engine/bench/decode_b64.py --out b64.json
"""

from __future__ import annotations

import argparse
import json
import random
import time

from gyre_engine.bench.run import Case, bandwidth, engine_run, make_model
from gyre_engine.server import decode_attn
from gyre_engine.server.engine import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON result file")
    ap.add_argument("--repeats", type=int, default=3, help="measured engine passes (the median is reported)")
    ap.add_argument("--prefill-chunk", type=int, default=8192)
    ap.add_argument("--run-steps", type=int, default=8)
    ap.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy; > 0: sampled rows (RL rollouts)"
    )
    ap.add_argument(
        "--warm-all",
        action="store_true",
        help="capture every batch and length bucket first (as `gyre-engine serve` does); else only the "
        "graphs the warm-up pass needs",
    )
    ap.add_argument("--attn-target", type=int, default=None, help="decode attention's target programs")
    ap.add_argument(
        "--compile-prefill", action="store_true", help="prefill through torch.compile (compile_prefill)"
    )
    args = ap.parse_args()
    if args.attn_target is not None:
        decode_attn.TARGET_PROGRAMS = args.attn_target
    c = Case("qwen3-0.6b", "bfloat16", 128, 256, (64,), 32768, 1024)
    model = make_model(c.shape, c.dtype, "cuda")
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1, model.config.vocab_size) for _ in range(n)]

    cfg = Engine.Config(
        max_running_requests=64,
        prefill_chunk=args.prefill_chunk,
        decode_slots="auto",
        compile_decode=True,
        run_steps=args.run_steps,
        compile_prefill=args.compile_prefill,
    )
    eng = Engine(model, None, cfg)
    eng.start()
    try:
        t0 = time.time()
        if args.warm_all:
            warm = eng.call(eng.warmup_decode, c.prompt_len + c.new_tokens).result(3600)
            print(f"graph warm-up {warm:.1f} s ({time.time() - t0:.1f} s wall)", flush=True)
        # warm-up at the measured shapes: 64 fresh prompts prefilled and decoded (compilation, the
        # graphs these shapes need, allocator segments, kernels loaded on first use); then `repeats`
        # measured passes, each on fresh prompts
        engine_run(eng, [prompt(c.prompt_len) for _ in range(64)], c.new_tokens, temperature=args.temperature)
        print(f"warm-up pass done {time.time() - t0:.1f} s", flush=True)
        passes = []
        for _ in range(args.repeats):
            prompts = [prompt(c.prompt_len) for _ in range(64)]
            s0 = eng.stats()
            wall = engine_run(eng, prompts, c.new_tokens, temperature=args.temperature)[0]
            s1 = eng.stats()
            passes.append(
                {
                    "engine_wall_s": wall,
                    "decode_s": s1.decode_time_s - s0.decode_time_s,
                    "prefill_s": s1.prefill_time_s - s0.prefill_time_s,
                    "decode_steps": s1.decode_steps - s0.decode_steps,
                    "decode_tokens": s1.decode_tokens - s0.decode_tokens,
                }
            )
            print(json.dumps(passes[-1]), flush=True)
        mid = sorted(passes, key=lambda p: p["engine_wall_s"])[len(passes) // 2]
        rate = mid["decode_tokens"] / max(mid["decode_s"], 1e-9)
        work = 64 * c.new_tokens
        result = {
            "b64": {
                "engine_tokens_per_s": work / mid["engine_wall_s"],
                "engine_decode_step_tokens_per_s": rate,
                "median_pass": mid,
                "passes": passes,
            },
            "bandwidth": bandwidth(model, c, rate),
            "decode_path": eng.slot_stats(),
            "attention_target_programs": decode_attn.TARGET_PROGRAMS,
            "compile_prefill": args.compile_prefill,
        }
    finally:
        eng.shutdown()
    print(json.dumps(result), flush=True)
    with open(args.out, "w") as f:
        f.write(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
