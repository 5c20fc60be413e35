"""transformers' plain `generate` alone in a fresh process (no engine, no compilation), on the bench's
work: Qwen3-0.6B shape, random bf16 weights, 128-token prompts, 256 new tokens, batch 1, 16 and 64.
Best of 2 per batch after a short warm-up. The baseline for `engine_over_generate` on a GPU: in the
engine's own process `generate` was measured 3x slower (see the README).

    PYTHONPATH=packages/gyre-engine/src python packages/gyre-engine/bench/generate_alone.py --out gen.json
"""

from __future__ import annotations

import argparse
import json
import random

from gyre_engine.bench.run import generate_run, make_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON result file")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,16,64", help="comma-separated batch sizes")
    args = ap.parse_args()
    model = make_model("qwen3-0.6b", args.dtype, args.device)
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1, model.config.vocab_size) for _ in range(n)]

    generate_run(model, [prompt(128)] * 2, 8, args.device)
    result = {}
    for b in [int(x) for x in args.batches.split(",")]:
        runs = [generate_run(model, [prompt(128) for _ in range(b)], 256, args.device) for _ in range(2)]
        result[f"b{b}"] = {"generate_tokens_per_s": b * 256 / min(runs), "runs_s": runs}
        print(b, result[f"b{b}"], flush=True)
    print(json.dumps(result), flush=True)
    with open(args.out, "w") as f:
        f.write(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
