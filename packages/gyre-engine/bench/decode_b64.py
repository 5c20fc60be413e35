"""Batch 64 only, on CUDA: the engine's slot/CUDA-graph decode path on 64 prompts (128 tokens each, 256
new tokens), in one process, plus the bandwidth fraction: a warm-up pass at the measured shapes, then the median of `--repeats` passes on fresh prompts. The baseline is
`generate_alone.py`, plain `generate` in a fresh process (in the engine's process it runs slower: see the
README). `--prefill-chunk` defaults to 8192, so the 64 prompts are prefilled in one pass;
`--temperature 0,1` measures greedy rows, then rows sampled at temperature 1 (drawn on the device in
runs), in one process.

    PYTHONPATH=packages/gyre-engine/src python packages/gyre-engine/bench/decode_b64.py --out b64.json
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

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
        "--temperature",
        default="0",
        help="comma-separated temperatures measured in turn in one process (one compilation): 0 is "
        "greedy, > 0 sampled rows (RL rollouts); the first is reported as `b64`",
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
    ap.add_argument("--device", default="cuda", help="cuda (the measurement); cpu only checks the script")
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--new-tokens", type=int, default=256)
    args = ap.parse_args()
    if args.attn_target is not None:
        decode_attn.TARGET_PROGRAMS = args.attn_target
    temps = [float(x) for x in args.temperature.split(",")]
    cuda = args.device == "cuda"
    c = Case(args.shape, "bfloat16" if cuda else "float32", 128, args.new_tokens, (64,), 32768, 1024)
    t0 = time.time()
    model = make_model(c.shape, c.dtype, args.device)
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1, model.config.vocab_size) for _ in range(n)]

    def say(what: str) -> None:
        print(f"{time.time() - t0:7.1f} s  {what}", flush=True)

    cfg = Engine.Config(
        max_running_requests=64,
        prefill_chunk=args.prefill_chunk,
        decode_slots="auto" if cuda else "eager",
        compile_decode=True,
        run_steps=args.run_steps,
        compile_prefill=args.compile_prefill,
    )
    eng = Engine(model, None, cfg)
    eng.start()
    say("model built, engine started")

    def measure(temperature: float) -> dict[str, Any]:
        # warm-up at the measured shapes: 64 fresh prompts prefilled and decoded (compilation, the
        # graphs these shapes need, allocator segments, kernels loaded on first use); then `repeats`
        # measured passes, each on fresh prompts
        engine_run(eng, [prompt(c.prompt_len) for _ in range(64)], c.new_tokens, temperature=temperature)
        say(f"temperature {temperature}: warm-up pass done")
        passes = []
        for _ in range(args.repeats):
            prompts = [prompt(c.prompt_len) for _ in range(64)]
            s0 = eng.stats()
            wall = engine_run(eng, prompts, c.new_tokens, temperature=temperature)[0]
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
            say(json.dumps(passes[-1]))
        mid = sorted(passes, key=lambda p: p["engine_wall_s"])[len(passes) // 2]
        rate = mid["decode_tokens"] / max(mid["decode_s"], 1e-9)
        return {
            "temperature": temperature,
            "engine_tokens_per_s": 64 * c.new_tokens / mid["engine_wall_s"],
            "engine_decode_step_tokens_per_s": rate,
            "bandwidth_fraction_b64": bandwidth(model, c, rate)["bandwidth_fraction_b64"],
            "median_pass": mid,
            "passes": passes,
        }

    try:
        if args.warm_all:
            warm = eng.call(eng.warmup_decode, c.prompt_len + c.new_tokens).result(3600)
            say(f"graph warm-up {warm:.1f} s")
        runs = [measure(t) for t in temps]
        rate = runs[0]["engine_decode_step_tokens_per_s"]
        result = {
            "b64": runs[0],
            "by_temperature": {str(r["temperature"]): r for r in runs},
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
