"""The prefix cache's host tier and the process's resident memory: contexts of the Qwen3-0.6B shape
(28 layers, 8 KV heads of 128, bf16: 112 KiB a token) spilled to the host tier one after another past
its budget, the way an engine under memory pressure spills them, on a thread of its own as the engine
thread does. Two ways of copying a spilled entry: plane by plane (one host tensor per layer's K and V,
tens of MiB each: what the cache does), or into one host buffer per entry (gigabytes, which the C library
maps and unmaps whole). Each runs in a fresh process, so neither sees the other's heap. The question it
answers: does the per-plane pattern leave freed memory in the process (heap fragmentation) on a scale
that explains an engine's resident memory growing by tens of GiB in a run?

    uv run python packages/gyre-engine/bench/host_tier_rss.py --out packages/gyre-engine/bench/results-host-tier-rss-cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import queue
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

LAYERS, HEADS, DIM = 28, 8, 128
KIB_PER_TOKEN = 2 * LAYERS * HEADS * DIM * 2 / 1024
MODES = ("per_plane", "one_buffer")


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _one_buffer(kv: object) -> object:
    """The alternative host copy: one buffer for every plane, the planes views of it."""
    import torch
    from gyre_engine.server.batch import RowKV

    assert isinstance(kv, RowKV)
    planes = (*kv.keys, *kv.values)
    buf = torch.empty((len(planes), *planes[0].shape), dtype=planes[0].dtype)
    for dst, src in zip(buf.unbind(0), planes, strict=True):
        dst.copy_(src)
    views = list(buf.unbind(0))
    return RowKV(views[: len(kv.keys)], views[len(kv.keys) :])


def _one_mode(mode: str, spills: int, host_tokens: int, seed: int) -> dict[str, object]:
    """`_spills` on a thread of this process (a fresh one: `main` runs each mode as a subprocess)."""
    q: queue.Queue[dict[str, object]] = queue.Queue()
    t = threading.Thread(target=_spills, args=(mode, spills, host_tokens, seed, q))
    t.start()
    t.join()
    return q.get_nowait()


def _spills(mode: str, spills: int, host_tokens: int, seed: int, q: queue.Queue[dict[str, object]]) -> None:
    import torch
    from gyre_engine.server import prefix_cache
    from gyre_engine.server.batch import RowKV

    torch.set_num_threads(1)
    if mode == "one_buffer":
        prefix_cache._to_host = _one_buffer  # type: ignore[assignment]
    rng = random.Random(seed)
    cache = prefix_cache.PrefixCache(max_tokens=12288, host_tokens=host_tokens)  # the last insert stays
    base = _rss_bytes()
    peak = base
    t0 = time.perf_counter()
    for i in range(spills):
        n = rng.randint(4096, 12288)
        planes = [torch.empty((1, HEADS, n, DIM), dtype=torch.bfloat16) for _ in range(2 * LAYERS)]
        kv = RowKV(planes[:LAYERS], planes[LAYERS:])
        cache.insert([10_000 + i, *range(n - 1)], kv, owned=True)  # a distinct first token: no prefix shared
        del kv, planes
        peak = max(peak, _rss_bytes())
    elapsed = time.perf_counter() - t0
    held = cache.host_held_tokens * KIB_PER_TOKEN * 1024
    q.put(
        {
            "mode": mode,
            "spills": spills,
            "host_tier_gib": round(held / 2**30, 2),
            "rss_growth_gib": round((_rss_bytes() - base) / 2**30, 2),
            "rss_peak_growth_gib": round((peak - base) / 2**30, 2),
            "seconds": round(elapsed, 1),
        }
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spills", type=int, default=48)
    p.add_argument("--host-tokens", type=int, default=32768)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    p.add_argument("--mode", choices=MODES, help="run one mode here and print its row (what main runs)")
    a = p.parse_args()
    if a.mode is not None:
        print(json.dumps(_one_mode(a.mode, a.spills, a.host_tokens, a.seed)))
        return
    rows = []
    for mode in MODES:
        argv = [sys.executable, __file__, "--mode", mode, "--spills", str(a.spills)]
        argv += ["--host-tokens", str(a.host_tokens), "--seed", str(a.seed)]
        done = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=3600)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    out = {
        "bench": "host_tier_rss",
        "machine": platform.machine(),
        "shape": {"layers": LAYERS, "kv_heads": HEADS, "head_dim": DIM, "dtype": "bfloat16"},
        "contexts_tokens": [4096, 12288],
        "host_tokens": a.host_tokens,
        "rows": rows,
        "rss_growth_ratio": round(rows[0]["rss_growth_gib"] / max(rows[1]["rss_growth_gib"], 0.01), 2),
        "seconds_ratio": round(rows[0]["seconds"] / max(rows[1]["seconds"], 0.1), 2),
    }
    print(json.dumps(out))
    if a.out is not None:
        a.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
