"""Batch 64 only, on CUDA: the engine's slot/CUDA-graph decode path against transformers' plain `generate`
on the same 64 prompts (128 tokens each, 256 new tokens), in one process, plus the bandwidth fraction.
Used on the H200 when the full `gyre-engine bench --device cuda` did not fit the time left.

    PYTHONPATH=packages/gyre-engine/src python packages/gyre-engine/bench/decode_b64.py --out b64.json
"""

from __future__ import annotations

import argparse
import json
import random
import time

from gyre_engine.bench.run import Case, bandwidth, engine_run, generate_run, make_model
from gyre_engine.server.engine import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON result file")
    args = ap.parse_args()
    c = Case("qwen3-0.6b", "bfloat16", 128, 256, (64,), 32768, 1024)
    model = make_model(c.shape, c.dtype, "cuda")
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1, model.config.vocab_size) for _ in range(n)]

    cfg = Engine.Config(max_running_requests=64, prefill_chunk=4096, decode_slots="auto", compile_decode=True)
    eng = Engine(model, None, cfg)
    eng.start()
    try:
        t0 = time.time()
        warm = eng.call(eng.warmup_decode, c.prompt_len + c.new_tokens).result(3600)
        print(f"graph warm-up {warm:.1f} s ({time.time() - t0:.1f} s wall)", flush=True)
        engine_run(eng, [prompt(c.prompt_len)] * 2, 4)
        generate_run(model, [prompt(c.prompt_len)] * 2, 4, "cuda")
        prompts = [prompt(c.prompt_len) for _ in range(64)]
        s0 = eng.stats()
        t_engine = engine_run(eng, prompts, c.new_tokens)[0]
        s1 = eng.stats()
        rate = (s1.decode_tokens - s0.decode_tokens) / max(s1.decode_time_s - s0.decode_time_s, 1e-9)
        t_generate = generate_run(model, prompts, c.new_tokens, "cuda")
        work = 64 * c.new_tokens
        result = {
            "b64": {
                "engine_tokens_per_s": work / t_engine,
                "engine_decode_step_tokens_per_s": rate,
                "generate_tokens_per_s": work / t_generate,
                "engine_over_generate": t_generate / t_engine,
                "engine_wall_s": t_engine,
                "decode_s": s1.decode_time_s - s0.decode_time_s,
                "prefill_s": s1.prefill_time_s - s0.prefill_time_s,
                "decode_steps": s1.decode_steps - s0.decode_steps,
            },
            "bandwidth": bandwidth(model, c, rate),
            "decode_path": eng.slot_stats(),
        }
    finally:
        eng.shutdown()
    print(json.dumps(result), flush=True)
    with open(args.out, "w") as f:
        f.write(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
