"""One agent's context grown to 700k tokens in one engine on one GPU (Qwen3-0.6B shape, random bf16
weights): time to first token and decode tokens/s at 8k, 64k, 256k and 700k, the decode's fraction of the
HBM bandwidth bound at 700k, and the time per token of short calls decoding beside a prefill at 700k.

The context is built by a sequence of calls, each extending the previous one (its prompt, its output, new
tokens), so the prefix cache carries it from call to call in the engine's long slot (`long_kv.py`): at
each milestone M, a build call extends the context to M - `--append` - 16 and decodes 16 tokens (which
also captures the decode graphs of that width), then the measured call appends `--append` tokens (a tool result) and
decodes `--new-tokens`. Its time to first token is that of an agent's call on a cached M-token context;
its decode tokens/s is the median over its decode runs (one event per run of `run_steps` tokens). The
last `--beside-tokens` of the build to the largest milestone are prefilled while short calls
(`--short-prompt` tokens, `--short-new` new, greedy) run beside it in two streams, each a call after call
(so some row always decodes); their decode time per token against the same two streams alone is
`short_call_tpot_ratio_beside_long_prefill` (summed over the calls that finished before the prefill did). Writes JSON (and rewrites it after each milestone).

    PYTHONPATH=packages/gyre-engine/src python packages/gyre-engine/bench/long_context.py --out long.json
    PYTHONPATH=packages/gyre-engine/src python packages/gyre-engine/bench/long_context.py --cpu --tiny --out /tmp/l.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from gyre_engine.bench.run import H200_BANDWIDTH, make_model
from gyre_engine.protocol import SamplingParams
from gyre_engine.server import decode_attn
from gyre_engine.server.engine import Engine
from gyre_engine.server.long_kv import chunk_attention, chunk_attention_path
from gyre_engine.server.request import EngineRequest, TokenEvent

SHORT_STREAMS = 2
"""Short calls run as this many streams at once (each a call after call), so some row is always decoding
while they run, alone and beside the prefill."""
BUILD_NEW = 16
"""Tokens each build call decodes (which also captures the decode graphs of its width)."""


@dataclass
class CallResult:
    prompt: int
    t_submit: float
    events: list[tuple[float, int]] = field(default_factory=list)
    """(time, tokens) per event."""
    output: list[int] = field(default_factory=list)
    cached: int = -1
    finish: str | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def ttft_s(self) -> float:
        return self.events[0][0] - self.t_submit

    @property
    def decode_s(self) -> float:
        return self.events[-1][0] - self.events[0][0]

    @property
    def decode_tokens(self) -> int:
        return sum(n for _, n in self.events[1:])

    def run_rates(self) -> list[float]:
        """Tokens/s of each decode event (a run of several steps, or one step) after the first."""
        return [n / (t - t0) for (t0, _), (t, n) in zip(self.events, self.events[1:], strict=False) if t > t0]

    def summary(self) -> dict[str, Any]:
        rates = self.run_rates()
        return {
            "context": self.prompt,
            "cached_tokens": self.cached,
            "prefilled_tokens": self.prompt - self.cached,
            "ttft_s": self.ttft_s,
            "new_tokens": len(self.output),
            "decode_tok_s_median_run": statistics.median(rates) if rates else None,
            "decode_tok_s_mean": self.decode_tokens / self.decode_s if self.decode_s > 0 else None,
        }


class Driver:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.n = 0
        self.lock = threading.Lock()

    def submit(self, ids: list[int], new_tokens: int) -> CallResult:
        res = CallResult(len(ids), time.perf_counter())
        with self.lock:
            self.n += 1
            rid = f"c{self.n}"

        def sink(ev: TokenEvent) -> None:
            res.events.append((time.perf_counter(), len(ev.token_ids)))
            res.output.extend(ev.token_ids)
            res.cached = ev.cached_tokens
            if ev.finish is not None:
                res.finish = ev.finish.type
                res.done.set()

        sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        self.engine.submit(EngineRequest(rid, ids, sp), sink).result(600)
        return res

    def call(self, ids: list[int], new_tokens: int, timeout: float = 1800.0) -> CallResult:
        res = self.submit(ids, new_tokens)
        if not res.done.wait(timeout):
            raise TimeoutError(f"a call of {len(ids)} tokens did not finish in {timeout:.0f} s")
        return checked(res)


def checked(res: CallResult) -> CallResult:
    if res.finish != "length" or not res.events:
        raise RuntimeError(f"a call of {res.prompt} tokens ended with {res.finish!r} (see the engine's log)")
    return res


def check_chunk_attention(mc: Any, dtype: torch.dtype, dev: str) -> dict[str, Any]:
    """The long prefill's attention on this device against a float32 reference with the mask built: a
    64-token chunk at the end of 300 columns, keys and values strided views of a larger buffer (`ok`: the
    largest error under 0.05, what bf16 rounding leaves; a misaligned causal mask errs by far more)."""
    h, kvh, d = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim
    gen = torch.Generator().manual_seed(0)
    buf = torch.randn((2, 1, kvh, 1024, d), generator=gen).to(dev, dtype)
    q = torch.randn((1, 64, h, d), generator=gen).to(dev, dtype).transpose(1, 2)  # as transformers has it
    k, v = buf[0, :, :, :300], buf[1, :, :, :300]
    out = chunk_attention(q, k, v, d**-0.5).float()
    kr, vr = (t.float().repeat_interleave(h // kvh, dim=1) for t in (k, v))
    scores = (q.float() @ kr.transpose(-1, -2)) * d**-0.5
    rows = torch.arange(64, device=dev)[:, None] + 300 - 64
    scores = scores.masked_fill(torch.arange(300, device=dev)[None] > rows, float("-inf"))
    ref = scores.softmax(-1) @ vr
    err = float((out - ref).abs().max())
    return {"path": chunk_attention_path(q, k), "max_abs_err": err, "ok": err < 0.05}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON result file")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (checks the script; use with --tiny)")
    ap.add_argument("--tiny", action="store_true", help="the tiny model and contexts of 256-4096 tokens")
    ap.add_argument("--contexts", default=None, help="comma-separated milestones (default 8k,64k,256k,700k)")
    ap.add_argument("--append", type=int, default=None, help="tokens each measured call appends")
    ap.add_argument("--new-tokens", type=int, default=None, help="tokens each measured call decodes")
    ap.add_argument("--prefill-chunk", type=int, default=None, help="tokens per prefill chunk")
    ap.add_argument("--prefill-share", type=float, default=Engine.Config.prefill_share)
    ap.add_argument(
        "--beside-tokens", type=int, default=None, help="last tokens of the build with short calls"
    )
    ap.add_argument("--short-prompt", type=int, default=None)
    ap.add_argument("--short-new", type=int, default=None)
    ap.add_argument("--compile-decode", action="store_true", help="torch.compile the decode step (minutes)")
    ap.add_argument("--attn-target", type=int, default=None, help="decode attention's target programs")
    args = ap.parse_args()
    tiny = args.tiny
    dev = "cpu" if args.cpu else "cuda"
    if args.attn_target is not None:
        decode_attn.TARGET_PROGRAMS = args.attn_target

    def pick(value: Any, big: Any, small: Any) -> Any:
        return value if value is not None else (small if tiny else big)

    contexts = [
        int(x) for x in pick(args.contexts, "8192,65536,262144,700000", "256,512,1024,4096").split(",")
    ]
    append = pick(args.append, 1024, 32)
    new_tokens = pick(args.new_tokens, 128, 24)
    chunk = pick(args.prefill_chunk, 4096, 16)
    beside = pick(args.beside_tokens, 32768, 2800)
    short_prompt = pick(args.short_prompt, 128, 16)
    short_new = pick(args.short_new, 512, 16)
    slot_max_len = 2048 if not tiny else 128
    capacity = -(-(max(contexts) + append + new_tokens + 256) // 1024) * 1024
    shape = "tiny" if tiny else "qwen3-0.6b"
    dtype = "float32" if args.cpu else "bfloat16"
    t0 = time.time()

    def say(what: str) -> None:
        print(f"{time.time() - t0:7.1f} s  {what}", flush=True)

    model = make_model(shape, dtype, dev, overrides={"max_position_embeddings": capacity + 1024})
    mc = model.config
    itemsize = next(model.parameters()).element_size()
    weight_bytes = sum(p.numel() for p in model.parameters()) * itemsize
    kv_per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * itemsize
    cfg = Engine.Config(
        max_running_requests=8,
        prefill_chunk=chunk,
        prefill_share=args.prefill_share,
        decode_slots="eager" if args.cpu else "auto",
        compile_decode=args.compile_decode,
        slot_max_len=slot_max_len,
        long_context_tokens=capacity,
        max_cached_tokens=capacity + 65536,
    )
    eng = Engine(model, None, cfg)
    eng.start()
    drv = Driver(eng)
    rng = random.Random(0)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(1, mc.vocab_size) for _ in range(n)]

    gb = capacity * kv_per_token / 1e9
    say(f"model built ({shape}, {dtype}, {dev}); long slot of {capacity} tokens ({gb:.1f} GB)")
    result_check = check_chunk_attention(mc, next(model.parameters()).dtype, dev)
    say(f"long prefill attention: {result_check}")
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        "shape": shape,
        "dtype": dtype,
        "context_built_by": (
            "a sequence of calls each extending the previous context (prompt + output + new tokens), the "
            "prefix cache carrying it in the long slot: per milestone one build call (to milestone - append - "
            "16, 16 new tokens) and one measured call (append tokens, new_tokens decoded) whose context is "
            "the milestone; not 658 calls"
        ),
        "settings": {
            "contexts": contexts,
            "append": append,
            "new_tokens": new_tokens,
            "prefill_chunk": chunk,
            "prefill_share": args.prefill_share,
            "long_context_tokens": capacity,
            "slot_max_len": slot_max_len,
            "compile_decode": args.compile_decode,
            "attention_target_programs": decode_attn.TARGET_PROGRAMS,
            "beside_tokens": beside,
            "short_prompt": short_prompt,
            "short_new": short_new,
        },
        "bandwidth_bound": {
            "hbm_bytes_per_s": H200_BANDWIDTH,
            "weight_bytes": weight_bytes,
            "kv_bytes_per_token": kv_per_token,
            "rule": "bytes per decode step = all weights + KV of the whole context; bound tok/s = "
            "hbm_bytes_per_s / that (one row)",
        },
        "chunk_attention_check": result_check,
        "calls": [],
        "ttft_s_by_context": {},
        "decode_tok_s_by_context": {},
    }

    def write() -> None:
        with open(args.out, "w") as f:
            f.write(json.dumps(result, indent=1) + "\n")

    seeds = iter(range(1, 1 << 30))

    def short_streams(until: Callable[[], bool] | None = None, each: int = 0) -> list[CallResult]:
        """`SHORT_STREAMS` threads each running short calls one after another: `each` calls, or until
        `until()` holds, keeping the calls that finished before it did (so some row is always decoding
        while the kept calls run)."""
        got: list[CallResult] = []
        lock = threading.Lock()

        def stream(seed: int) -> None:
            r = random.Random(seed)
            n = 0
            while (until is None and n < each) or (until is not None and not until()):
                c = drv.call([r.randrange(1, mc.vocab_size) for _ in range(short_prompt)], short_new)
                n += 1
                if until is None or not until():
                    with lock:
                        got.append(c)

        threads = [threading.Thread(target=stream, args=(next(seeds),)) for _ in range(SHORT_STREAMS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(1800)
        return got

    def per_token(calls: list[CallResult]) -> float:
        return sum(c.decode_s for c in calls) / max(1, sum(c.decode_tokens for c in calls))

    try:
        short_streams(each=1)  # warm-up: captures the short slots' graphs
        alone = short_streams(each=3)
        alone_s_per_tok = per_token(alone)
        say(f"short calls alone ({SHORT_STREAMS} streams): {1 / alone_s_per_tok:.1f} tok/s each")
        ctx: list[int] = []
        for i, m in enumerate(contexts):
            last = i == len(contexts) - 1
            target = m - append - BUILD_NEW  # the measured call's context is then m tokens
            if last and beside > 0 and target - len(ctx) > beside:  # the build up to the last leg
                grow = ctx + fresh(target - beside - len(ctx))
                b = drv.call(grow, BUILD_NEW)
                result["calls"].append({"role": "build", **b.summary()})
                say(f"built {b.prompt} (ttft {b.ttft_s:.2f} s)")
                ctx = _extend(grow, b)
            if len(ctx) < target:
                grow = ctx + fresh(target - len(ctx))
                if last and beside > 0:
                    long_call = drv.submit(grow, BUILD_NEW)
                    shorts = short_streams(lambda c=long_call: bool(c.events))
                    if not long_call.done.wait(1800):
                        raise TimeoutError("the build call did not finish")
                    b = checked(long_call)
                    side_tok = sum(c.decode_tokens for c in shorts)
                    ratio = per_token(shorts) / alone_s_per_tok if side_tok else None
                    per_call = [
                        (c.decode_s / c.decode_tokens) / alone_s_per_tok for c in shorts if c.decode_tokens
                    ]
                    result["short_call_tpot_ratio_beside_long_prefill"] = ratio
                    result["short_calls_beside"] = {
                        "prefill": f"tokens {b.cached} to {b.prompt} of the context",
                        "calls": len(shorts),
                        "alone_s_per_token": alone_s_per_tok,
                        "beside_s_per_token": per_token(shorts) if side_tok else None,
                        "streams": SHORT_STREAMS,
                        "per_call_ratio": per_call,
                        "per_call_ttft_s": [c.ttft_s for c in shorts],
                    }
                    say(f"{len(shorts)} short calls beside the prefill to {b.prompt}: tpot ratio {ratio}")
                else:
                    b = drv.call(grow, BUILD_NEW)
                result["calls"].append({"role": "build", **b.summary()})
                say(f"built {b.prompt} (ttft {b.ttft_s:.2f} s)")
                ctx = _extend(grow, b)
            measured = ctx + fresh(append)
            r = drv.call(measured, new_tokens)
            summ = r.summary()
            result["calls"].append({"role": "measured", "milestone": m, **summ})
            key = str(m)
            result["ttft_s_by_context"][key] = r.ttft_s
            result["decode_tok_s_by_context"][key] = summ["decode_tok_s_median_run"]
            say(f"context {r.prompt}: ttft {r.ttft_s:.3f} s, decode {summ['decode_tok_s_median_run']} tok/s")
            ctx = _extend(measured, r)
            if last and summ["decode_tok_s_median_run"]:
                step_bytes = weight_bytes + (r.prompt + new_tokens // 2) * kv_per_token
                bound = H200_BANDWIDTH / step_bytes
                result["decode_bandwidth_fraction_700k"] = summ["decode_tok_s_median_run"] / bound
                result["bandwidth_bound"]["context"] = r.prompt + new_tokens // 2
                result["bandwidth_bound"]["bytes_per_step"] = step_bytes
                result["bandwidth_bound"]["bound_tok_s"] = bound
            result["decode_path"] = eng.slot_stats()
            result["elapsed_s"] = time.time() - t0
            write()
    finally:
        eng.shutdown()
    print(json.dumps(result), flush=True)
    write()


def _extend(prompt: list[int], call: CallResult) -> list[int]:
    """The agent's context after a call: its prompt and its output."""
    return prompt + call.output


if __name__ == "__main__":
    main()
