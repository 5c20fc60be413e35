"""Where a prefix hand-off's time goes, per byte: KV of the Qwen3-0.6B shape (28 layers x 8 KV heads x
128 dims, bfloat16: 112 KiB per token) moved over gyre-xfer's shared memory on CPU.

Run from the repository root: `uv run python packages/gyre-engine/bench/kv_move.py [--context N]
[--reps R] [--out FILE]`. Two parts, the last line printed is one JSON object:

- `stages`: in one process, an offering `XferHub` and an importing one (their own transports, as two
  engines have): the offer (copy out of the cache's tensors into the offered pool), the pull (the
  transport's copy, then the copy into the importer's KV tensors) and the release, each timed, with the
  imported KV checked equal to the source's; `per_byte_ns` is each stage's seconds per KV byte.
- `servers`: two `gyre-engine serve --device cpu` processes of a model with that KV shape (tiny hidden
  size and vocabulary, so prefill is cheap per token): the hand-off end to end from the client (offer,
  pull, install, receipt), against the same call prefilled again on the target, and the moved call's
  `cached_tokens` checked.

Medians over `reps` after one untimed round. One thread per process (`torch.set_num_threads(1)`, and
`OMP_NUM_THREADS=1` for the servers): the bench shares a small machine.
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
from typing import Any

import httpx
import torch
from gyre_base.ports import free_port
from gyre_engine.client import EngineClient, handoff_prefix
from gyre_engine.protocol import OfferPrefixRequest, SamplingParams
from gyre_engine.server.batch import RowKV
from gyre_engine.server.xfer import XferHub

ONE = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
LAYERS, KV_HEADS, HEAD_DIM = 28, 8, 128
SHAPE = dict(  # the KV of Qwen3-0.6B; the rest as small as a model allows
    num_hidden_layers=LAYERS,
    num_key_value_heads=KV_HEADS,
    num_attention_heads=KV_HEADS,
    head_dim=HEAD_DIM,
    hidden_size=64,
    intermediate_size=128,
)


def stages(context: int, reps: int, block_tokens: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)

    def plane() -> torch.Tensor:
        return torch.randn(1, KV_HEADS, context, HEAD_DIM, generator=g).to(torch.bfloat16)

    kv = RowKV([plane() for _ in range(LAYERS)], [plane() for _ in range(LAYERS)])
    ids = list(range(context))
    src, dst = XferHub(), XferHub()
    src.transport("shm"), dst.transport("shm")
    times: dict[str, list[float]] = {"offer": [], "pull": [], "transport": [], "release": [], "total": []}
    try:
        for r in range(reps + 1):
            t0 = time.perf_counter()
            offer = src.offer(OfferPrefixRequest(ids, block_tokens=block_tokens), ids, kv, "fp", "v0")
            t1 = time.perf_counter()
            got, res = dst.pull_prefix(offer, LAYERS, torch.device("cpu"), 30.0)
            t2 = time.perf_counter()
            src.release(offer.offer_id, [b.src_block for b in res.blocks if b.status.name == "OK"])
            t3 = time.perf_counter()
            pairs = zip((*got.keys, *got.values), (*kv.keys, *kv.values), strict=True)
            assert all(torch.equal(a, b) for a, b in pairs), "imported KV differs"
            if r:
                for k, v in (("offer", t1 - t0), ("pull", t2 - t1), ("transport", res.elapsed_s)):
                    times[k].append(v)
                times["release"].append(t3 - t2)
                times["total"].append(t3 - t0)
            del got
    finally:
        src.close()
        dst.close()
    nbytes = kv.nbytes()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "context_tokens": context,
        "block_tokens": block_tokens,
        "kv_bytes": nbytes,
        "median_s": {k: round(v, 4) for k, v in med.items()},
        "per_byte_ns": {k: round(v / nbytes * 1e9, 4) for k, v in med.items()},
    }


def start(model: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "gyre_engine", "serve", "--model", str(model), "--port", str(port)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [*cmd, "--device", "cpu"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
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


async def servers(a: str, b: str, context: int, reps: int, block_tokens: int) -> dict[str, Any]:
    ids = [(i * 7919) % 1900 + 10 for i in range(context)]
    call = [*ids, 5]  # the agent's next call: the context plus one token
    times: dict[str, list[float]] = {"handoff": [], "moved_ttft": [], "reprefill_ttft": []}
    async with EngineClient(a, timeout_s=600) as ca, EngineClient(b, timeout_s=600) as cb:
        await ca.generate(ids, ONE)  # A caches the context
        for r in range(reps + 1):
            await cb.flush_cache()
            t0 = time.perf_counter()
            reply = await handoff_prefix(ca, cb, ids, transport="shm", block_tokens=block_tokens)
            t1 = time.perf_counter()
            got = await cb.generate(call, ONE)
            t2 = time.perf_counter()
            assert reply is not None and reply.success and got.meta_info.cached_tokens >= context - 1
            await cb.flush_cache()
            t3 = time.perf_counter()
            cold = await cb.generate(call, ONE)
            t4 = time.perf_counter()
            assert cold.meta_info.cached_tokens == 0
            assert cold.output_ids == got.output_ids, "the moved prefix gave another next token"
            if r:
                times["handoff"].append(t1 - t0)
                times["moved_ttft"].append(t2 - t0)
                times["reprefill_ttft"].append(t4 - t3)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "context_tokens": context,
        "block_tokens": block_tokens,
        "median_s": {k: round(v, 4) for k, v in med.items()},
        "reprefill_over_moved": round(med["reprefill_ttft"] / med["moved_ttft"], 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--skip-servers", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    result: dict[str, Any] = {"load_avg_before": list(os.getloadavg())}
    result["stages"] = stages(args.context, args.reps, args.block_tokens)
    if not args.skip_servers:
        from gyre_engine.server.model_factory import create_model

        with tempfile.TemporaryDirectory() as tmp:
            model = create_model(Path(tmp) / "m", shape="tiny", seed=0, dtype="bfloat16", overrides=SHAPE)
            (pa, a), (pb, b) = start(model), start(model)
            try:
                result["servers"] = asyncio.run(servers(a, b, args.context, args.reps, args.block_tokens))
            finally:
                for proc in (pa, pb):
                    proc.terminate()
                    proc.wait(30)
    result["load_avg_after"] = list(os.getloadavg())
    line = json.dumps(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(line)


if __name__ == "__main__":
    main()
