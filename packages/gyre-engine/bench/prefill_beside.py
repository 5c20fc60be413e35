"""An agent's next call prefilled on top of its cached context, eagerly (`prefill.prefill_packed`, what
the engine ran before) against one graph replay into a decode slot (`slot_prefill.SlotPrefill`), alone on
the GPU and beside a second process that keeps the GPU busy (a trainer's stand-in: back-to-back bf16
matmuls of `--neighbour-n` squared, or, with `--neighbour small`, bursts of small kernels launched one by
one as an engine's eager passes launch them).

Per case (rows x new tokens on top of `--cached` cached tokens each), the median and 90th percentile of
`--reps` passes, each timed from its start on the host to its first tokens on the host (the argmax of
its logits read back): where a pass alone takes a few milliseconds and the same pass beside the
neighbour takes tens, the time went to waiting for the GPU between kernels, not to the kernels. The model is the Qwen3-0.6B shape with random weights in bfloat16, fused projections and norms
as the engine runs it.

    PYTHONPATH=packages/gyre-engine/src python packages/gyre-engine/bench/prefill_beside.py --out results.json

On a CPU it runs the tiny shape, eagerly only (for checking the script).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

NEIGHBOURS = {
    "matmul": (
        "import torch, sys\n"
        "n = int(sys.argv[1])\n"
        "a = torch.randn(n, n, device='cuda', dtype=torch.bfloat16)\n"
        "print('ready', flush=True)\n"
        "while True:\n"
        "    a = (a @ a).clamp_(-1, 1)\n"
    ),
    "small": (
        "import torch, sys\n"
        "x = torch.randn(64, 1024, device='cuda', dtype=torch.bfloat16)\n"
        "print('ready', flush=True)\n"
        "while True:\n"
        "    for _ in range(400):\n"
        "        x = torch.nn.functional.silu(x) * 0.5 + 0.1\n"
        "    torch.cuda.synchronize()\n"
    ),
}


def start_neighbour(kind: str, n: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", NEIGHBOURS[kind], str(n)],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "ready" not in line:
        proc.kill()
        raise RuntimeError(f"the neighbour did not start: {line!r}")
    time.sleep(1.0)
    return proc


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def one_case(
    model: Any, sp: Any, kw: str, cached: int, rows: int, new: int, reps: int, seed: int
) -> dict[str, Any]:
    """Median and p90 seconds of one pass, eager and (on CUDA) graphed, for `rows` calls of `new` tokens."""
    from gyre_engine.server.batch import RowKV, cache_layers
    from gyre_engine.server.prefill import prefill_chunk, prefill_packed, start_cache

    dev = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    vocab = int(model.config.vocab_size)
    ctxs = [torch.randint(10, vocab - 10, (cached + new,), generator=g).tolist() for _ in range(rows)]
    with torch.inference_mode():
        prefixes = []
        for ctx in ctxs:
            cache = start_cache(None)
            prefill_chunk(model, kw, ctx, cache, 0, cached, dev)
            prefixes.append(RowKV(*cache_layers(cache)))

        def eager() -> None:
            caches = [start_cache(kv) for kv in prefixes]
            logits = prefill_packed(
                model, kw, [(c, cached, k) for c, k in zip(ctxs, caches, strict=True)], dev
            )
            logits.float().argmax(-1).tolist()

        def graphed() -> None:
            logits, _ = sp.run([(kv, c, cached) for kv, c in zip(prefixes, ctxs, strict=True)])
            logits.float().argmax(-1).tolist()

        out: dict[str, Any] = {"rows": rows, "new_tokens": new, "cached": cached}
        paths = {"eager": eager}
        if sp is not None and sp.fits([(cached + new, new)] * rows):
            paths["graph"] = graphed
        for name, fn in paths.items():
            for _ in range(3):
                fn()
            secs = []
            for _ in range(reps):
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                secs.append(time.perf_counter() - t0)
            out[f"{name}_ms_median"] = round(1000 * statistics.median(secs), 2)
            out[f"{name}_ms_p90"] = round(1000 * pct(secs, 0.9), 2)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cached", type=int, default=1024)
    p.add_argument("--cases", default="1x32,1x100,4x60,8x32", help="rows x new tokens, comma list")
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--neighbours", default="none,matmul,small", help="none, matmul, small; comma list")
    p.add_argument("--neighbour-n", type=int, default=8192)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    from gyre_engine.bench.run import make_model
    from gyre_engine.server.batch import cache_kwarg
    from gyre_engine.server.fused import FusedProjections
    from gyre_engine.server.norms import available, fuse_rms_norms
    from gyre_engine.server.slot_prefill import SlotPrefill
    from gyre_engine.server.slots import SlotBatch

    cuda = torch.cuda.is_available()
    model = make_model(
        "qwen3-0.6b" if cuda else "tiny", "bfloat16" if cuda else "float32", "cuda" if cuda else "cpu"
    )
    FusedProjections(model)
    if available(next(model.parameters()).device):
        fuse_rms_norms(model)
    kw = cache_kwarg(model)
    sp = None
    if cuda:
        slots = SlotBatch(model, slots=8, max_len=a.cached + 512, use_graphs=True, full_width=True)
        sp = SlotPrefill(slots, 256)
        sp.warmup()
    cases = [tuple(int(x) for x in c.split("x")) for c in a.cases.split(",")]
    out: dict[str, Any] = {
        "bench": "prefill_beside",
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "cached": a.cached,
        "reps": a.reps,
        "neighbour_n": a.neighbour_n,
        "runs": [],
    }
    for kind in a.neighbours.split(","):
        if kind != "none" and not cuda:
            continue
        proc = start_neighbour(kind, a.neighbour_n) if kind != "none" else None
        try:
            for i, (r, n) in enumerate(cases):
                res = {"neighbour": kind, **one_case(model, sp, kw, a.cached, r, n, a.reps, i)}
                print(json.dumps(res), flush=True)
                out["runs"].append(res)
        finally:
            if proc is not None:
                proc.kill()
                proc.wait()
        if a.out is not None:
            a.out.write_text(json.dumps(out, indent=1) + "\n")
    if sp is not None:
        out["slot_prefill"] = sp.stats
    if a.out is not None:
        a.out.write_text(json.dumps(out, indent=1) + "\n")
    else:
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
