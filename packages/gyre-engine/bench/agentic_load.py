"""One engine under the agent-shaped load of `integration/examples/h200-agentic.toml`, in process, at several
`max_running` settings side by side: where its time goes and what more rows buy.

`--agents` agents (default 48, what each of that run's two engines served at once: three batches of 32
executions side by side) each run executions back to back: a 1,024-token prompt, then calls whose context
is the previous call's context, its output (lognormal lengths, median 150, 50-400 tokens, sampled by the
model) and a tool output (lognormal, median 1,500, 512-4,096 random tokens), with lognormal tool time
(median 1.5 s) between calls; past 24,576 tokens the context is compacted back to the prompt and a
512-token summary, and an execution ends after 8-40 calls (lognormal, median 10). Agents start at
staggered points of an execution, so the load is steady from the start. The engine has the run's engine
settings (full-width slots of 12.3k tokens sized by `slot_kv_fraction`, six long slots of 33,280 tokens,
4,608-token prefill chunks, 49,152 cached tokens on the device and a host tier of 262,144) and the
Qwen3-0.6B shape with random weights in bfloat16.

Per setting of `--max-running` and of the decode attention's bound on the tiles a program walks
(`--max-tiles`, `decode_attn.MAX_CHUNK_TILES`; 0: none) and of the engine's fused RMS norms
(`--fuse-norms 0,1`) and of its rotary embedding as one kernel (`--fuse-rotary 0,1`), its
`slot_kv_fraction` scaled with
`max_running` so that every slot keeps 12.3k tokens, after `--warm-s` of load, over `--measure-s`: calls finished, output tokens/s, each call's
latency (submit to last token) and wait for its first token (medians, 90th percentiles), and the engine's
counters (seconds in steps, decode and prefill; decode steps and rows a step; prefill tokens computed and
cached; request-seconds waiting, by what held them). With `--profile-s`, a torch.profiler window of that
many seconds at the end of each setting's measurement: the GPU's kernel seconds against the window's
wall seconds (how much of the time the GPU computed), the top kernels and the top host ops; with
`--python-s`, the engine thread's Python functions under cProfile for that long after it.

On CUDA it first checks the fused RMS norm's and the rotary embedding's kernels against transformers'
functions in bfloat16 (`norm_check`, `rotary_check`, the latter with both timed at a decode step's
shape). `--sweep 0,4,8` times the decode attention alone at each bound (`attention_sweep`).

    PYTHONPATH=packages/gyre-engine/src python packages/gyre-engine/bench/agentic_load.py \
        --max-running 16 --fuse-norms 0,1 --out results-agentic-load.json

On a CPU it runs the tiny shape with small contexts (`--tiny`, for checking the script).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch


class Shape:
    """The execution profile (lengths in tokens, times in seconds), the agentic config's."""

    def __init__(self, tiny: bool) -> None:
        s = 1 / 16 if tiny else 1.0
        self.prompt = int(1024 * s)
        self.output = (150.0 * s, 0.6, max(4, int(50 * s)), int(400 * s))
        self.tool = (1500.0 * s, 0.6, int(512 * s), int(4096 * s))
        self.tool_s = (0.15 if tiny else 1.5, 0.5)
        self.calls = (10.0, 0.5, 8, 40)
        self.compact = int(24576 * s)
        self.summary = int(512 * s)


def lognormal(rng: random.Random, median: float, sigma: float, lo: float, hi: float) -> float:
    return min(hi, max(lo, median * math.exp(rng.gauss(0.0, sigma))))


class Load:
    """The agents' threads and what they measured; calls that end while `measuring` is set are kept."""

    def __init__(self, engine: Any, shape: Shape, agents: int, vocab: int, seed: int) -> None:
        self.engine, self.shape, self.vocab = engine, shape, vocab
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.measuring = False
        self.calls: list[tuple[float, float, int]] = []  # (latency, first-token wait, output tokens)
        self.failed: list[str] = []
        self.threads = [
            threading.Thread(target=self.agent, args=(i, seed), daemon=True, name=f"agent-{i}")
            for i in range(agents)
        ]

    def tokens(self, rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(10, self.vocab) for _ in range(n)]

    def grown(self, ctx: list[int], new: list[int], rng: random.Random) -> list[int]:
        """`ctx` extended by `new` (a call's output and its tool output); past the compaction threshold,
        the prompt and a summary instead."""
        ctx = ctx + new
        if len(ctx) > self.shape.compact:
            ctx = ctx[: self.shape.prompt] + self.tokens(rng, self.shape.summary)
        return ctx

    def agent(self, i: int, seed: int) -> None:
        from gyre_engine.protocol import SamplingParams
        from gyre_engine.server.request import EngineRequest, TokenEvent

        rng = random.Random(seed * 7919 + i)
        sh = self.shape
        first = True
        k = 0
        while not self.stop.is_set():
            ctx = self.tokens(rng, sh.prompt)
            calls = int(lognormal(rng, *sh.calls))
            start = rng.randrange(calls) if first else 0  # staggered: the first execution starts midway
            for _ in range(start):
                made = int(lognormal(rng, *sh.output)) + int(lognormal(rng, *sh.tool))
                ctx = self.grown(ctx, self.tokens(rng, made), rng)
            first = False
            for _ in range(start, calls):
                if self.stop.is_set():
                    return
                out: list[int] = []
                done = threading.Event()
                firsts: list[float] = []

                def sink(
                    ev: TokenEvent,
                    out: list[int] = out,
                    done: threading.Event = done,
                    firsts: list[float] = firsts,
                ) -> None:
                    if not firsts:
                        firsts.append(time.perf_counter())
                    out.extend(ev.token_ids)
                    if ev.finish is not None:
                        done.set()

                n = int(lognormal(rng, *sh.output))
                sp = SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True)
                t0 = time.perf_counter()
                k += 1
                self.engine.submit(EngineRequest(f"a{i}-{k}", list(ctx), sp), sink).result(120)
                if not done.wait(600):
                    with self.lock:
                        self.failed.append(f"a{i}-{k}")
                    return
                t1 = time.perf_counter()
                with self.lock:
                    if self.measuring:
                        self.calls.append((t1 - t0, firsts[0] - t0, len(out)))
                ctx = self.grown(ctx, out + self.tokens(rng, int(lognormal(rng, *sh.tool))), rng)
                self.stop.wait(lognormal(rng, sh.tool_s[0], sh.tool_s[1], 0.0, 30.0))


def counters(engine: Any) -> dict[str, Any]:
    st = engine.stats()
    return {
        "step_s": st.step_time_s,
        "decode_s": st.decode_time_s,
        "prefill_s": st.prefill_time_s,
        "command_s": st.command_time_s,
        "decode_steps": st.decode_steps,
        "decode_tokens": st.decode_tokens,
        "prefill_computed": st.prefill_tokens_computed,
        "prefill_cached": st.prefill_tokens_cached,
        "host_hit_tokens": st.host_hit_tokens,
        "memory_evicted_tokens": st.memory_evicted_tokens,
        "waiting_s": dict(st.waiting_s),
    }


def delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in b.items():
        if isinstance(v, dict):
            out[k] = {w: round(v[w] - a[k].get(w, 0.0), 1) for w in v}
        else:
            out[k] = round(v - a[k], 3) if isinstance(v, float) else v - a[k]
    return out


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def profile_window(seconds: float) -> dict[str, Any]:
    """Every thread's CPU ops and the GPU's kernels for `seconds` of the running load."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    extra: dict[str, Any] = {}
    try:
        from torch._C._profiler import _ExperimentalConfig

        extra["experimental_config"] = _ExperimentalConfig(profile_all_threads=True)
    except (ImportError, TypeError):
        pass
    t0 = time.perf_counter()
    with profile(activities=acts, **extra) as prof:
        time.sleep(seconds)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    events = prof.key_averages()

    def dev_us(e: Any) -> float:
        return float(getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0))

    kernels = [e for e in events if e.device_type.name == "CUDA" and dev_us(e) > 0]
    host = sorted((e for e in events if e.device_type.name == "CPU"), key=lambda e: -e.self_cpu_time_total)
    gpu_s = sum(dev_us(e) for e in kernels) / 1e6
    return {
        "wall_s": round(wall, 3),
        "gpu_kernel_s": round(gpu_s, 3),
        "gpu_busy_share": round(gpu_s / wall, 3),
        "kernels": sum(e.count for e in kernels),
        "top_kernels": [
            {"name": e.key[:120], "count": e.count, "ms": round(dev_us(e) / 1e3, 2)}
            for e in sorted(kernels, key=lambda e: -dev_us(e))[:25]
        ],
        "top_host_ops": [
            {"name": e.key[:120], "count": e.count, "self_ms": round(e.self_cpu_time_total / 1e3, 2)}
            for e in host[:25]
        ],
    }


def python_window(engine: Any, seconds: float) -> dict[str, Any]:
    """The engine thread's Python functions for `seconds` (cProfile, enabled on that thread by a command
    it runs): the top functions by their own time and by their cumulative time. cProfile slows Python
    code, not the GPU's, so the shares lean towards the host."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    engine.call(prof.enable).result(60)
    time.sleep(seconds)
    engine.call(prof.disable).result(60)
    st = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (file, line, fn), (_cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        rows.append(
            {
                "fn": f"{Path(file).name}:{line}:{fn}",
                "calls": nc,
                "own_s": round(tt, 3),
                "cum_s": round(ct, 3),
            }
        )
    return {
        "seconds": seconds,
        "by_own": sorted(rows, key=lambda r: -r["own_s"])[:30],
        "by_cumulative": sorted(rows, key=lambda r: -r["cum_s"])[:40],
    }


def attention_sweep(caps: list[int], seed: int = 0) -> dict[str, Any]:
    """The slot step's decode attention alone (`triton_decode_attention` with the step's new key and
    value, one layer, timed as a CUDA graph's replay by `kernels_b64.timed`, median of 50) for each bound on a program's tiles
    in `caps`: 16 decode slots of 12,288 columns and 6 long slots of 33,280, every slot taken, row
    lengths uniform over the slot's width (about what the load's rows hold), Qwen3-0.6B's heads."""
    from gyre_engine.server.decode_attn import plan_splits, triton_decode_attention
    from kernels_b64 import timed  # this folder's script (on sys.path when run as one)

    g = torch.Generator(device="cuda").manual_seed(seed)
    out: dict[str, Any] = {}
    for name, rows, width in (("slots_16x12288", 16, 12288), ("long_6x33280", 6, 33280)):
        kv = torch.randn(2, rows, 8, width, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        q = torch.randn(rows, 16, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        kn = torch.randn(rows, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        vn = torch.randn_like(kn)
        valid = torch.randint(1, width, (rows,), device="cuda", generator=g)
        moved = 2 * int(valid.sum()) * 8 * 128 * 2  # the keys and values the rows attend, in bytes
        by_cap: dict[str, Any] = {}
        for cap in caps:
            fn = functools.partial(
                triton_decode_attention,
                q,
                kv[0],
                kv[1],
                valid,
                128**-0.5,
                new_key=kn,
                new_value=vn,
                max_tiles=cap,
            )
            us = 1e3 * timed(fn, reps=50)  # kernels_b64's: a CUDA graph's replay, median
            by_cap[str(cap)] = {
                "us": round(us, 1),
                "splits": plan_splits(rows, 8, width, max_tiles=cap)[0],
                "gb_s": round(moved / us / 1e3, 1),
            }
        out[name] = {
            "rows": rows,
            "width": width,
            "attended_mb": round(moved / 1e6, 1),
            "by_max_tiles": by_cap,
        }
    return out


def norm_check() -> dict[str, Any]:
    """The fused RMS norm's kernel against transformers' forward in bfloat16 on this GPU: the share of
    outputs that differ and the largest difference in units of the output's last place."""
    from gyre_engine.server.norms import reference_rms_norm, triton_rms_norm

    g = torch.Generator(device="cuda").manual_seed(0)
    out: dict[str, Any] = {}
    cases = {
        "64x1024": (3 * torch.randn(64, 1024, device="cuda", generator=g)).bfloat16(),
        "64x16x128": (3 * torch.randn(64, 16, 128, device="cuda", generator=g)).bfloat16(),
        "4608x1024": (3 * torch.randn(4608, 1024, device="cuda", generator=g)).bfloat16(),
        # the query heads of a fused q/k/v projection's output, read in place
        "64x16x128_of_64x4096": (3 * torch.randn(64, 4096, device="cuda", generator=g))
        .bfloat16()[:, :2048]
        .view(64, 16, 128),
    }
    for name, x in cases.items():
        w = torch.randn(x.shape[-1], device="cuda", generator=g).bfloat16()
        got, want = triton_rms_norm(x, w, 1e-6), reference_rms_norm(x, w, 1e-6)
        ulp = torch.finfo(torch.bfloat16).eps * want.float().abs().clamp_min(1e-30)
        out[name] = {
            "differ_share": round(float((got != want).float().mean()), 5),
            "max_ulps": round(float(((got.float() - want.float()).abs() / ulp).max()), 2),
        }
    return out


def rotary_check() -> dict[str, Any]:
    """The rotary kernel against transformers' `apply_rotary_pos_emb` in bfloat16 on this GPU, on the
    Qwen3-0.6B heads (16 query, 8 key heads of 128) laid out as the attention hands them over: whether
    the outputs are equal bit for bit, and each one's time a layer (median of 200, CUDA events) at a
    decode step's 8 and 64 rows and a prefill's 4,608 tokens."""
    from gyre_engine.server.rotary import triton_rotary
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb as theirs

    theirs = getattr(theirs, "gyre_original", theirs)  # transformers' own, were it replaced already
    g = torch.Generator(device="cuda").manual_seed(0)
    out: dict[str, Any] = {}
    for b, t in ((8, 1), (64, 1), (1, 4608)):
        q = (3 * torch.randn(b, t, 16, 128, device="cuda", generator=g)).bfloat16().transpose(1, 2)
        k = (3 * torch.randn(b, t, 8, 128, device="cuda", generator=g)).bfloat16().transpose(1, 2)
        pos = torch.arange(t, device="cuda") + 1000.0
        freq = 1e6 ** (-torch.arange(0, 128, 2, device="cuda") / 128)
        ang = torch.cat([pos[:, None] * freq[None, :]] * 2, dim=-1)[None].expand(b, t, 128)
        cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
        got, want = triton_rotary(q, k, cos, sin), theirs(q, k, cos, sin)
        times = {}
        for name, fn in (("kernel", triton_rotary), ("transformers", theirs)):
            ms = []
            for _ in range(200):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                fn(q, k, cos, sin)
                e1.record()
                e1.synchronize()
                ms.append(e0.elapsed_time(e1))
            times[f"{name}_us"] = round(1000 * statistics.median(ms), 1)
        out[f"{b}x{t}"] = {"equal": all(torch.equal(x, y) for x, y in zip(got, want, strict=True)), **times}
    return out


def one_setting(
    model: Any, a: argparse.Namespace, rows: int, cap: int, fuse: bool, rotary: bool
) -> dict[str, Any]:
    from gyre_engine.server import decode_attn
    from gyre_engine.server.engine import Engine

    decode_attn.MAX_CHUNK_TILES = cap  # read by every step's plan (captured into the graphs at start-up)

    tiny = a.tiny
    base = 16
    cfg = Engine.Config(
        max_running_requests=rows,
        slot_kv_fraction=a.kv_fraction * rows / base,
        slot_widths="full",
        compile_decode=False,
        long_context_tokens=2080 if tiny else 33280,
        long_context_slots=6,
        max_cached_tokens=(3072 if tiny else 49152),
        host_cached_tokens=(16384 if tiny else 262144),
        prefill_chunk=288 if tiny else 4608,
        min_free_bytes=0 if tiny else 12 << 30,
        slot_max_len=768 if tiny else None,
        decode_slots="auto" if torch.cuda.is_available() else "eager",
        fuse_norms=fuse,
        fuse_rotary=rotary,
    )
    t0 = time.perf_counter()
    engine = Engine(model, None, cfg)
    engine.start()
    warm_tokens = 512 if not tiny else 64
    engine.call(engine.warmup_decode, warm_tokens).result()
    startup = time.perf_counter() - t0
    load = Load(engine, Shape(tiny), a.agents, int(model.config.vocab_size), a.seed)
    try:
        for t in load.threads:
            t.start()
        time.sleep(a.warm_s)
        with load.lock:
            load.measuring = True
        c0, w0 = counters(engine), time.perf_counter()
        time.sleep(a.measure_s)
        c1, w1 = counters(engine), time.perf_counter()
        with load.lock:
            load.measuring = False
            calls = list(load.calls)
        prof = profile_window(a.profile_s) if a.profile_s > 0 else None
        py = python_window(engine, a.python_s) if a.python_s > 0 else None
    finally:
        load.stop.set()
        for t in load.threads:
            t.join(timeout=120)
        slots = engine.slot_stats()
        engine.shutdown()
    if load.failed:
        raise RuntimeError(f"calls that did not finish: {load.failed[:5]}")
    d = delta(c0, c1)
    wall = w1 - w0
    lat = [c[0] for c in calls]
    wait = [c[1] for c in calls]
    out_tokens = sum(c[2] for c in calls)
    steps = max(1, d["decode_steps"])
    res: dict[str, Any] = {
        "max_running": rows,
        "attention_max_tiles": cap,
        "fuse_norms": fuse,
        "fuse_rotary": rotary,
        "slot_kv_fraction": round(cfg.slot_kv_fraction, 3),
        "startup_s": round(startup, 2),
        "window_s": round(wall, 2),
        "calls": len(calls),
        "calls_per_s": round(len(calls) / wall, 3),
        "output_tok_s": round(out_tokens / wall, 1),
        "decode_tok_s": round(d["decode_tokens"] / wall, 1),
        "latency_s_median": round(statistics.median(lat), 3) if lat else None,
        "latency_s_p90": round(pct(lat, 0.9), 3) if lat else None,
        "first_token_s_median": round(statistics.median(wait), 3) if wait else None,
        "first_token_s_p90": round(pct(wait, 0.9), 3) if wait else None,
        "rows_per_step": round(d["decode_tokens"] / steps, 2),
        "step_ms": round(1e3 * d["decode_s"] / steps, 3),
        "engine": d,
        "engine_busy_share": round(d["step_s"] / wall, 3),
        "prefill_share_of_steps": round(d["prefill_s"] / max(d["step_s"], 1e-9), 3),
        "prefill_tok_s": round(d["prefill_computed"] / max(d["prefill_s"], 1e-9), 1),
        "slots": {k: v for k, v in slots.items() if isinstance(v, int | float | bool)},
    }
    if torch.cuda.is_available():
        res["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
        torch.cuda.reset_peak_memory_stats()
    if prof is not None:
        res["profile"] = prof
    if py is not None:
        res["python"] = py
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-running", default="16,32", help="comma list, run in turn")
    p.add_argument("--kv-fraction", type=float, default=0.15, help="slot_kv_fraction at 16 rows")
    p.add_argument("--agents", type=int, default=48)
    p.add_argument("--warm-s", type=float, default=20.0)
    p.add_argument("--measure-s", type=float, default=60.0)
    p.add_argument("--profile-s", type=float, default=0.0)
    p.add_argument("--max-tiles", default="0", help="decode attention's MAX_CHUNK_TILES, comma list")
    p.add_argument("--fuse-norms", default="1", help="the engine's fuse_norms, comma list of 0/1")
    p.add_argument("--fuse-rotary", default="0", help="the engine's fuse_rotary, comma list of 0/1")
    p.add_argument("--sweep", default="", help="time the decode attention alone at these MAX_CHUNK_TILES")
    p.add_argument("--python-s", type=float, default=0.0, help="cProfile the engine thread this long")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="the tiny shape on small contexts (any device)")
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    from gyre_engine.bench.run import make_model

    cuda = torch.cuda.is_available()
    model = make_model(
        "tiny" if a.tiny else "qwen3-0.6b", "bfloat16" if cuda else "float32", "cuda" if cuda else "cpu"
    )
    out: dict[str, Any] = {
        "bench": "agentic_load",
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "agents": a.agents,
        "tiny": a.tiny,
        "warm_s": a.warm_s,
        "measure_s": a.measure_s,
        "settings": [],
    }
    if a.sweep and cuda:
        out["attention_sweep"] = attention_sweep([int(x) for x in a.sweep.split(",")])
        print(json.dumps(out["attention_sweep"]), flush=True)
    if cuda:
        out["norm_check"] = norm_check()
        print(json.dumps(out["norm_check"]), flush=True)
        out["rotary_check"] = rotary_check()
        print(json.dumps(out["rotary_check"]), flush=True)
    # every setting without fused norms first, and without the fused rotary embedding: an engine that
    # fuses them changes the forward of the model's norm modules and the rotary function of its modeling
    # file, which every later engine in this process keeps (so only one of the two can be compared)
    norms, rotaries = sorted(set(a.fuse_norms.split(","))), sorted(set(a.fuse_rotary.split(",")))
    if len(norms) > 1 and len(rotaries) > 1:
        p.error("compare --fuse-norms or --fuse-rotary in one run, not both")
    settings = [
        (int(r), int(c), f == "1", o == "1")
        for f in norms
        for o in rotaries
        for r in a.max_running.split(",")
        for c in a.max_tiles.split(",")
    ]
    for rows, cap, fuse, rotary in settings:
        r = one_setting(model, a, rows, cap, fuse, rotary)
        print(json.dumps({k: v for k, v in r.items() if k not in ("profile", "slots", "python")}), flush=True)
        out["settings"].append(r)
        if a.out is not None:
            a.out.write_text(json.dumps(out, indent=1) + "\n")
        if cuda:
            torch.cuda.empty_cache()
    if a.out is None:
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
