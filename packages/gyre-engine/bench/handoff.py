"""Prefix hand-off between two `gyre-engine serve` processes: through gyre-xfer (Mooncake TCP, shared
memory) against the KvPrefix-in-an-HTTP-body path and against a cold prefill on the target, same run.

Run from the repository root: `uv run python packages/gyre-engine/bench/handoff.py [--context N]
[--reps R] [--out FILE]`. The last line printed is one JSON object. Each hand-off is timed end to end
from the client (offer, pull, install, receipt; transports already open), then the target's next call is checked for
`cached_tokens`; the cold prefill is the same call after a cache flush.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from gyre_base.ports import free_port
from gyre_engine.client import EngineClient, handoff_prefix
from gyre_engine.protocol import SamplingParams

ONE = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)


def start(model: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "gyre_engine", "serve", "--model", str(model), "--port", str(port)]
    proc = subprocess.Popen(
        [*cmd, "--device", "cpu"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ)
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise TimeoutError("server did not start in 180 s")


async def measure(a: str, b: str, context: int, reps: int) -> dict[str, object]:
    ids = [(i * 7919) % 2000 + 10 for i in range(context)]
    call = [*ids, 5]  # the agent's next call: the context plus one token
    times: dict[str, list[float]] = {"cold_prefill": [], "http_body": [], "mooncake": [], "shm": []}
    async with EngineClient(a, timeout_s=600) as ca, EngineClient(b, timeout_s=600) as cb:
        await ca.generate(ids, ONE)  # A caches the context
        for how in ("mooncake", "shm"):  # open both transports on both sides (Mooncake start-up is not timed)
            await handoff_prefix(ca, cb, ids[:64], transport=how)
        for _ in range(reps):
            await cb.flush_cache()
            t0 = time.perf_counter()
            r = await cb.generate(call, ONE)
            times["cold_prefill"].append(time.perf_counter() - t0)
            assert r.meta_info.cached_tokens == 0
            for how in ("http_body", "mooncake", "shm"):
                await cb.flush_cache()
                t0 = time.perf_counter()
                if how == "http_body":
                    rec = await ca.export_prefix(call)
                    assert rec is not None
                    await cb.import_prefix(rec)
                else:
                    reply = await handoff_prefix(ca, cb, call, transport=how, block_tokens=256)
                    assert reply is not None and reply.success
                times[how].append(time.perf_counter() - t0)
                r = await cb.generate(call, ONE)
                assert r.meta_info.cached_tokens >= context - 1
    med = {k: statistics.median(v) for k, v in times.items()}
    kv_bytes = 2 * 2 * 2 * 16 * 4 * context  # tiny model: 2 layers, K and V, 2 heads x 16 dims, float32
    return {
        "context_tokens": context,
        "kv_mib": round(kv_bytes / 2**20, 2),
        "reps": reps,
        "median_s": {k: round(v, 4) for k, v in med.items()},
        "mooncake_over_cold_prefill": round(med["mooncake"] / med["cold_prefill"], 4),
        "shm_over_cold_prefill": round(med["shm"] / med["cold_prefill"], 4),
        "mooncake_over_http_body": round(med["mooncake"] / med["http_body"], 4),
        "shm_over_http_body": round(med["shm"] / med["http_body"], 4),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from gyre_engine.server.model_factory import create_model

    with tempfile.TemporaryDirectory() as tmp:
        model = create_model(Path(tmp) / "tiny", shape="tiny", seed=0)
        (pa, a), (pb, b) = start(model), start(model)
        try:
            result = asyncio.run(measure(a, b, args.context, args.reps))
        finally:
            for proc in (pa, pb):
                proc.terminate()
                proc.wait(30)
    line = json.dumps(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(line)


if __name__ == "__main__":
    main()
