"""The prefix cache's host tier and the process's resident memory: contexts of the Qwen3-0.6B shape
(28 layers, 8 KV heads of 128, bf16: 112 KiB a token) spilled to a host tier one after another past its
budget (the oldest entries dropped to make room), the way an engine under memory pressure spills them,
on a thread of its own as the engine thread does. Three ways of holding a spilled entry: a host tensor
per layer's K and V (tens of MiB each: what the cache did before its arena), one host buffer per entry
(gigabytes, which the C library maps and unmaps whole), or a span of one buffer of the tier's size
allocated once (`HostArena`: what the cache does). Each runs in a fresh process, so none sees another's
heap. The question it answers: how much memory does the process keep for a tier of a given size, and
what does each way cost in copy time?

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
from collections import deque
from pathlib import Path

LAYERS, HEADS, DIM = 28, 8, 128
KIB_PER_TOKEN = 2 * LAYERS * HEADS * DIM * 2 / 1024
MODES = ("per_plane", "one_buffer", "arena")


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _per_plane(kv: object) -> object:
    """A host tensor per plane, as `Tensor.to("cpu")` makes it."""
    from gyre_engine.server.batch import RowKV

    assert isinstance(kv, RowKV)
    return RowKV([k.to("cpu", copy=True) for k in kv.keys], [v.to("cpu", copy=True) for v in kv.values])


def _one_buffer(kv: object) -> object:
    """One buffer for every plane, the planes views of it."""
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
    from gyre_engine.server.batch import RowKV
    from gyre_engine.server.host_arena import HostArena

    torch.set_num_threads(1)
    rng = random.Random(seed)
    token_bytes = int(KIB_PER_TOKEN * 1024)
    arena = HostArena(host_tokens * token_bytes) if mode == "arena" else None
    held: deque[tuple[int, object]] = deque()  # (tokens, host copy), oldest first
    held_tokens = 0
    base = _rss_bytes()
    peak = base
    copy_s = 0.0
    t0 = time.perf_counter()
    if arena is not None:
        arena.reserve()  # allocated once, at start-up (timed with the run)
    for _ in range(spills):
        n = rng.randint(4096, 12288)
        planes = [torch.empty((1, HEADS, n, DIM), dtype=torch.bfloat16) for _ in range(2 * LAYERS)]
        kv = RowKV(planes[:LAYERS], planes[LAYERS:])
        c0 = time.perf_counter()  # making room and copying
        if arena is None:
            while held and held_tokens + n > host_tokens:
                held_tokens -= held.popleft()[0]
            copy = _per_plane(kv) if mode == "per_plane" else _one_buffer(kv)
        else:
            while (copy := arena.place(kv)) is None:
                gone, old = held.popleft()
                held_tokens -= gone
                arena.release(old)  # type: ignore[arg-type]
                del old
        copy_s += time.perf_counter() - c0
        held.append((n, copy))
        held_tokens += n
        del kv, planes, copy
        peak = max(peak, _rss_bytes())
    elapsed = time.perf_counter() - t0
    q.put(
        {
            "mode": mode,
            "spills": spills,
            "host_tier_gib": round(held_tokens * token_bytes / 2**30, 2),
            "rss_growth_gib": round((_rss_bytes() - base) / 2**30, 2),
            "rss_peak_growth_gib": round((peak - base) / 2**30, 2),
            "seconds": round(elapsed, 1),
            "copy_seconds": round(copy_s, 1),
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
        "rss_growth_over_tier": {
            str(r["mode"]): round(
                float(r["rss_growth_gib"]) / max(a.host_tokens * KIB_PER_TOKEN / 2**20, 0.01), 2
            )
            for r in rows
        },
    }
    print(json.dumps(out))
    if a.out is not None:
        a.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
