"""An agent-shaped load on one engine, in process, on the CPU with the tiny model: 32 agents, each making 8
calls whose context is the previous call's context, its output (10-40 tokens, sampled) and a tool output
(50-300 random tokens), with up to 0.1 s of tool time between calls. The engine has 16 decode slots of
512 tokens, 3 long slots of 4,096, 256-token prefill chunks, 8,192 cached tokens on the device and a
host tier of 8,192. Contexts pass 512 tokens after a few calls, so most calls need a long slot and
many the chunked prefill: the load exercises admission, not the model.

Reported (median run of `--runs`): the wall seconds for all 256 calls, the engine thread's seconds in
steps, decode and prefill, and the request-seconds its queue spent waiting, by what held the requests
(`EngineStats.waiting_s`). `--prefill-chunks 256,384` runs each chunk size in turn, run by run, and
reports each (`by_prefill_chunk`): at 384 every call's new tokens (at most 40 + 300) are prefilled at
admission; at 256 about a third of them go through the one chunked prefill.

    uv run python packages/gyre-engine/bench/agent_load.py --out packages/gyre-engine/bench/results-agent-load-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

AGENTS, CALLS = 32, 8


def one_run(model: Path, seed: int, prefill_chunk: int = 256) -> dict[str, Any]:
    from gyre_engine.protocol import SamplingParams
    from gyre_engine.server.engine import Engine
    from gyre_engine.server.request import EngineRequest, TokenEvent
    from gyre_engine.server.serve import ServeConfig, load_engine

    cfg = Engine.Config(
        decode_slots="eager",
        slot_max_len=512,
        long_context_tokens=4096,
        long_context_slots=3,
        prefill_chunk=prefill_chunk,
        max_running_requests=16,
        max_cached_tokens=8192,
        host_cached_tokens=8192,
        run_steps=1,
    )
    engine = load_engine(ServeConfig(model=str(model), device="cpu", engine=cfg))
    rng = random.Random(seed)
    plans = [
        (
            [rng.randrange(1000) for _ in range(150 + rng.randrange(100))],
            [(10 + rng.randrange(30), 50 + rng.randrange(250), rng.random() * 0.1) for _ in range(CALLS)],
        )
        for _ in range(AGENTS)
    ]
    failed: list[str] = []

    def agent(i: int) -> None:
        ctx, calls = plans[i]
        tool_rng = random.Random(seed * 1000 + i)
        for k, (out_len, tool_len, sleep_s) in enumerate(calls):
            done, out = threading.Event(), []

            def sink(ev: TokenEvent, out: list[int] = out, done: threading.Event = done) -> None:
                out.extend(ev.token_ids)
                if ev.finish is not None:
                    done.set()

            sp = SamplingParams(max_new_tokens=out_len, temperature=1.0, ignore_eos=True)
            engine.submit(EngineRequest(f"a{i}-{k}", list(ctx), sp), sink).result(60)
            if not done.wait(600):
                failed.append(f"a{i}-{k}")
                return
            ctx = ctx + out + [tool_rng.randrange(1000) for _ in range(tool_len)]
            time.sleep(sleep_s)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=agent, args=(i,)) for i in range(AGENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    st = engine.stats()
    engine.shutdown()
    if failed:
        raise RuntimeError(f"calls that did not finish: {failed}")
    return {
        "wall_s": round(wall, 2),
        "step_s": round(st.step_time_s, 2),
        "decode_s": round(st.decode_time_s, 2),
        "prefill_s": round(st.prefill_time_s, 2),
        "decode_steps": st.decode_steps,
        "decode_tokens": st.decode_tokens,
        "host_hit_tokens": st.host_hit_tokens,
        "waiting_s": {k: round(v, 1) for k, v in st.waiting_s.items()},
    }


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Runs' wall seconds, their median, and the median run's figures."""
    return {
        "runs_wall_s": [r["wall_s"] for r in runs],
        "wall_s_median": statistics.median(r["wall_s"] for r in runs),
        "median_run": sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    p.add_argument("--prefill-chunks", default="256", help="prefill chunk sizes, run in turn (default 256)")
    a = p.parse_args()
    chunks = [int(x) for x in a.prefill_chunks.split(",")]
    from gyre_engine.server.model_factory import create_model

    with tempfile.TemporaryDirectory() as tmp:
        model = create_model(Path(tmp) / "model", shape="tiny", seed=0)
        by_chunk: dict[int, list[dict[str, Any]]] = {c: [] for c in chunks}
        for _ in range(a.runs):
            for c in chunks:
                by_chunk[c].append(one_run(model, a.seed, c))
                print(json.dumps({"prefill_chunk": c, **by_chunk[c][-1]}), flush=True)
    runs = by_chunk[chunks[0]]
    out: dict[str, Any] = {
        "bench": "agent_load",
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "agents": AGENTS,
        "calls_each": CALLS,
        **summary(runs),
        "prefill_chunk": chunks[0],
    }
    if len(chunks) > 1:
        out["by_prefill_chunk"] = {str(c): summary(rs) for c, rs in by_chunk.items()}
    print(json.dumps(out))
    if a.out is not None:
        a.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
