"""The report's size of execution served call by call: gyre-traj's synthetic 700k execution (658 calls: a
main agent whose context grows to 700k tokens between three compactions, eight sub-agents, retries) sent
to one engine on one GPU (Qwen3-0.6B shape, random bf16 weights) in its recorded order, one call at a
time, the prefix cache carrying each context to the next call.

Each call sends its whole input, as a harness does: a full input as recorded, else its delta parent's
input and output cut at `keep`, then the tokens it appends (tool outputs, user turns). The parent's
output is what the engine sampled for it: the first `--decode` tokens of each call are decoded (greedy,
`ignore_eos`), the rest of its recorded output length is taken from the record, as tokens the next call
prefills (decoding all 155k output tokens at these contexts would take about 25 minutes). The main
agent's context lives in the engine's one long slot (701k tokens, 78 GB of KV); the sub-agents' contexts
(at most 3.3k tokens) decode in its ordinary slots. So every call
finds its context's prefix in the cache, except that remainder and what it appends. Token ids are the
record's (mapped into the model's vocabulary where it is smaller).

Reported: per call, its context, the tokens found cached, time to first token and decode tok/s; medians of
those over the calls whose context is within 20% of 8k, 64k, 256k and 700k (`ttft_s_by_context`,
`decode_tok_s_by_context`); the share of input tokens served from the prefix cache
(`prefix_cache_hit_share`). `--budget-s` stops sending calls after that many seconds (what was served is
written, with `calls_served`); the JSON is rewritten every `--write-every` calls.

    PYTHONPATH=packages/gyre-engine/src:packages/gyre-traj/src:packages/gyre-base/src \\
        python packages/gyre-engine/bench/serve_execution.py --out serve.json --budget-s 480
    ... serve_execution.py --cpu --tiny --out /tmp/s.json    (checks the script: a 40-call execution)
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import torch
from gyre_engine.bench.run import make_model
from gyre_engine.protocol import SamplingParams
from gyre_engine.server.engine import Engine
from gyre_engine.server.long_kv import chunk_attention_path
from gyre_engine.server.request import EngineRequest, TokenEvent
from gyre_traj.records import Call
from gyre_traj.synth import SynthConfig, synth_execution

MILESTONES = (8192, 65536, 262144, 700000)
TINY_MILESTONES = (256, 512, 1024, 3000)
NEAR = 0.2
"""A call counts for a milestone when its context is within this fraction of it."""


@dataclass
class Served:
    """One call as the engine served it."""

    context: int
    t_submit: float
    events: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    cached: int = -1
    finish: str | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def summary(self, call: Call) -> dict[str, Any]:
        ttft = self.events[0] - self.t_submit
        decode_s = self.events[-1] - self.events[0]
        decoded = len(self.tokens) - 1
        return {
            "call_id": call.call_id,
            "role": call.role.value,
            "context": self.context,
            "cached_tokens": self.cached,
            "ttft_s": round(ttft, 5),
            "decoded_tokens": len(self.tokens),
            "decode_tok_s": round(decoded / decode_s, 2) if decode_s > 0 and decoded > 0 else None,
        }


def serve(engine: Engine, rid: str, ids: list[int], new_tokens: int, timeout: float = 1800.0) -> Served:
    res = Served(len(ids), time.perf_counter())

    def sink(ev: TokenEvent) -> None:
        now = time.perf_counter()
        res.events.extend([now] * max(1, len(ev.token_ids)))
        res.tokens.extend(ev.token_ids)
        res.cached = ev.cached_tokens
        if ev.finish is not None:
            res.finish = ev.finish.type
            res.done.set()

    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine.submit(EngineRequest(rid, ids, sp), sink).result(600)
    if not res.done.wait(timeout) or res.finish != "length":
        raise RuntimeError(f"call {rid} ({len(ids)} tokens) ended with {res.finish!r} (see the engine's log)")
    return res


def near(calls: list[dict[str, Any]], key: str, milestones: tuple[int, ...]) -> dict[str, float | None]:
    """Per milestone, the median of `key` over the calls whose context is within `NEAR` of it."""
    out: dict[str, float | None] = {}
    for m in milestones:
        xs = [c[key] for c in calls if c[key] is not None and abs(c["context"] - m) <= NEAR * m]
        out[str(m)] = statistics.median(xs) if xs else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON result file")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (checks the script; use with --tiny)")
    ap.add_argument("--tiny", action="store_true", help="the tiny model and a 40-call execution")
    ap.add_argument("--decode", type=int, default=None, help="tokens each call decodes (16; 4 with --tiny)")
    ap.add_argument("--prefill-chunk", type=int, default=None, help="tokens per prefill chunk")
    ap.add_argument("--budget-s", type=float, default=float("inf"), help="stop sending calls after this")
    ap.add_argument("--write-every", type=int, default=25, help="rewrite the JSON every this many calls")
    args = ap.parse_args()
    tiny = args.tiny
    dev = "cpu" if args.cpu else "cuda"
    synth = (
        SynthConfig(main_calls=30, max_context=3000, subagents=2, subagent_calls=3, system_tokens=200,
                    summary_tokens=100, output_tokens=(8, 40), seed=1)
        if tiny
        else SynthConfig(seed=1)
    )  # fmt: skip
    decode = args.decode if args.decode is not None else (4 if tiny else 16)
    milestones = TINY_MILESTONES if tiny else MILESTONES
    chunk = args.prefill_chunk if args.prefill_chunk is not None else (64 if tiny else 4096)
    t0 = time.time()

    def say(what: str) -> None:
        print(f"{time.time() - t0:7.1f} s  {what}", flush=True)

    calls = synth_execution(synth, "serve")
    longest = 0
    lengths: dict[str, int] = {}
    for c in calls:
        n_in = len(c.input_ids) if c.input_ids is not None else c.input_delta.keep + len(c.input_delta.append)
        lengths[c.call_id] = n_in + len(c.output_ids)
        longest = max(longest, lengths[c.call_id])
    capacity = -(-(longest + 1024) // 1024) * 1024
    shape = "tiny" if tiny else "qwen3-0.6b"
    dtype = "float32" if args.cpu else "bfloat16"
    model = make_model(shape, dtype, dev, overrides={"max_position_embeddings": capacity + 1024})
    vocab = int(model.config.vocab_size)
    mc = model.config
    kv = torch.zeros((1, mc.num_key_value_heads, 320, mc.head_dim), dtype=model.dtype, device=dev)
    q = torch.zeros((1, mc.num_attention_heads, 64, mc.head_dim), dtype=model.dtype, device=dev)
    attention_path = chunk_attention_path(q, kv)  # (the long prefill's kernel: flash, flash-split, repeat)
    cfg = Engine.Config(
        max_running_requests=8,
        prefill_chunk=chunk,
        decode_slots="eager" if args.cpu else "auto",
        compile_decode=False,
        slot_max_len=128 if tiny else 4096,  # (sub-agents' contexts, at most 3.3k tokens, decode in slots)
        long_context_tokens=capacity,
        max_cached_tokens=capacity + (4096 if tiny else 65536),
    )
    engine = Engine(model, None, cfg)
    engine.start()
    say(f"{len(calls)} calls, longest {longest} tokens; {shape} {dtype} on {dev}, long slot of {capacity}")

    def ids(xs: Any) -> np.ndarray:
        xs = np.asarray(xs, np.int64)
        return xs % (vocab - 1) + 1 if xs.size and int(xs.max()) >= vocab else xs

    # call id -> the input and output the engine saw for it, kept until the last call that extends it
    full: dict[str, np.ndarray] = {}
    last_use = {c.input_delta.parent: k for k, c in enumerate(calls) if c.input_delta is not None}
    served: list[dict[str, Any]] = []
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        "shape": shape,
        "dtype": dtype,
        "execution": {
            "calls": len(calls),
            "longest_tokens": longest,
            "synth": {k: v for k, v in synth.__dict__.items() if not k.startswith("_")},
        },
        "settings": {
            "decode_tokens": decode,
            "prefill_chunk": chunk,
            "long_context_tokens": capacity,
            "max_cached_tokens": cfg.max_cached_tokens,
            "budget_s": args.budget_s,
            "slot_max_len": cfg.slot_max_len,
            "long_prefill_attention": attention_path,
            "milestones": milestones,
            "milestone_window": NEAR,
        },
        "calls": served,
    }

    def write() -> None:
        hit = sum(c["cached_tokens"] for c in served)
        total = sum(c["context"] for c in served)
        result.update(
            calls_served=len(served),
            prefix_cache_hit_share=hit / total if total else None,
            ttft_s_by_context=near(served, "ttft_s", milestones),
            decode_tok_s_by_context=near(served, "decode_tok_s", milestones),
            elapsed_s=time.time() - t0,
            engine=msgspec.to_builtins(engine.stats()),
            decode_path=engine.slot_stats(),
        )
        with open(args.out, "w") as f:
            f.write(json.dumps(result, indent=1, default=str) + "\n")

    try:
        for k, c in enumerate(calls):
            if time.time() - t0 > args.budget_s:
                say(f"budget spent: {k} of {len(calls)} calls served")
                break
            if c.input_delta is None:
                assert c.input_ids is not None
                inp = ids(c.input_ids)
            else:
                d = c.input_delta
                inp = np.concatenate([full[d.parent][: d.keep], ids(d.append)])
                if last_use[d.parent] == k:
                    del full[d.parent]
            out_len = len(c.output_ids)
            res = serve(engine, f"c{k}", inp.tolist(), max(1, min(decode, out_len)))
            sampled = np.asarray(res.tokens[:out_len], np.int64)
            if c.call_id in last_use:
                full[c.call_id] = np.concatenate([inp, sampled, ids(c.output_ids[len(sampled) :])])
            served.append(res.summary(c))
            if (k + 1) % args.write_every == 0:
                last = served[-1]
                say(
                    f"call {k + 1}: context {last['context']}, cached {last['cached_tokens']}, ttft {last['ttft_s']} s"
                )
                write()
    finally:
        engine.shutdown()
        write()
    say(f"{len(served)} calls served; prefix cache hit share {result['prefix_cache_hit_share']}")
    print(json.dumps({k: v for k, v in result.items() if k != "calls"}, default=str), flush=True)


if __name__ == "__main__":
    main()
