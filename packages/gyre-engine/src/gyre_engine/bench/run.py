"""`gyre-engine bench`: decode throughput of the engine against transformers' plain `generate` on the same
work in the same run (1, 16 and 64 concurrent requests), and the cost of a call that appends tokens to a
cached context against a cold prefill. Models are made here with random weights (no download).

Prints one JSON object as its last line. Top-level keys come from the first case (the one with the
32k + 1k prefix workload; on CPU the tiny model, on CUDA the 0.6B-shaped one):
`batch64_over_batch1`, `cached_call_over_cold_prefill`, and on CUDA `bandwidth_fraction_b64` (decode
tokens/s at batch 64 against the memory-bandwidth bound: weights + KV bytes read per step / 4.8 TB/s).
Needs torch and transformers (and msgspec, which the engine's records use); no HTTP, no network.
"""

from __future__ import annotations

import json
import platform
import random
import statistics
import threading
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig

from gyre_engine.protocol import SamplingParams
from gyre_engine.server.engine import Engine
from gyre_engine.server.model_factory import SHAPES, shape_config
from gyre_engine.server.request import EngineRequest, TokenEvent

H200_BANDWIDTH = 4.8e12  # bytes/s


@dataclass(frozen=True)
class Case:
    shape: str
    dtype: str
    prompt_len: int
    new_tokens: int
    batches: tuple[int, ...]
    context: int
    append: int
    repeats: int = 1


def cases(quick: bool, device: str) -> list[Case]:
    if device.startswith("cuda"):
        if quick:
            return [Case("qwen3-0.6b", "bfloat16", 128, 64, (1, 16, 64), 8192, 1024)]
        return [Case("qwen3-0.6b", "bfloat16", 128, 256, (1, 16, 64), 32768, 1024, repeats=3)]
    if quick:
        return [Case("tiny", "float32", 32, 32, (1, 16, 64), 8192, 512)]
    return [
        Case("tiny", "float32", 64, 64, (1, 16, 64), 32768, 1024, repeats=3),
        Case("qwen3-0.6b", "float32", 16, 16, (1, 16, 64), 2048, 256),
    ]


def make_model(shape: str, dtype: str, device: str, overrides: dict[str, Any] | None = None) -> Any:
    cfg = shape_config(
        shape,
        vocab_size=SHAPES[shape].vocab_size or 2048,
        eos_token_id=0,
        pad_token_id=0,
        overrides=overrides,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg).to(getattr(torch, dtype)).eval()
    model.generation_config = GenerationConfig(eos_token_id=None, pad_token_id=0, do_sample=False)
    return model


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def engine_run(
    engine: Engine,
    prompts: list[list[int]],
    new_tokens: int,
    timeout: float = 3600.0,
    temperature: float = 0.0,
) -> tuple[float, int]:
    """Submit all prompts at once (greedy, or sampled at `temperature`); returns (wall seconds until all
    finished, cached tokens of the last)."""
    done = threading.Semaphore(0)
    cached = [0]

    def sink(ev: TokenEvent) -> None:
        if ev.finish is not None:
            cached[0] = ev.cached_tokens
            done.release()

    sp = SamplingParams(max_new_tokens=new_tokens, temperature=temperature, ignore_eos=True)
    t0 = time.perf_counter()
    futs = [
        engine.submit(EngineRequest(f"b{i}-{time.monotonic_ns()}", p, sp), sink)
        for i, p in enumerate(prompts)
    ]
    for f in futs:
        f.result(timeout)
    for _ in prompts:
        if not done.acquire(timeout=timeout):
            raise TimeoutError("benchmark request did not finish")
    return time.perf_counter() - t0, cached[0]


def generate_run(model: Any, prompts: list[list[int]], new_tokens: int, device: str) -> float:
    ids = torch.tensor(prompts, device=device)
    _sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
        )
    _sync(device)
    return time.perf_counter() - t0


def bench_case(
    c: Case, device: str, decode_slots: str = "auto", compile_decode: bool = True
) -> dict[str, Any]:
    model = make_model(c.shape, c.dtype, device)
    vocab = model.config.vocab_size
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(n)]

    cfg = Engine.Config(
        max_running_requests=max(c.batches),
        prefill_chunk=4096,
        decode_slots=decode_slots,
        compile_decode=compile_decode,
    )
    engine = Engine(model, None, cfg)
    engine.start()
    try:
        # capture the decode graphs up front (CUDA; as `serve --warmup-decode-tokens` does), then warm up
        # (allocator, kernels) both paths
        warmup_s = engine.call(engine.warmup_decode, c.prompt_len + c.new_tokens).result(3600)
        print(f"decode path: {json.dumps({**engine.slot_stats(), 'graph_warmup_s': warmup_s})}", flush=True)
        engine_run(engine, [prompt(c.prompt_len)] * 2, 4)
        generate_run(model, [prompt(c.prompt_len)] * 2, 4, device)
        decode: dict[str, Any] = {}
        for b in c.batches:
            prompts = [prompt(c.prompt_len) for _ in range(b)]
            e_times, g_times, d_rates = [], [], []
            for _ in range(c.repeats):
                engine.call(engine.flush_cache).result(60)
                st0 = engine.stats()
                e_times.append(engine_run(engine, prompts, c.new_tokens)[0])
                st1 = engine.stats()
                d_rates.append(
                    (st1.decode_tokens - st0.decode_tokens) / max(st1.decode_time_s - st0.decode_time_s, 1e-9)
                )
                g_times.append(generate_run(model, prompts, c.new_tokens, device))
            work = b * c.new_tokens
            decode[f"b{b}"] = {
                "engine_tokens_per_s": work / statistics.median(e_times),
                "engine_decode_step_tokens_per_s": statistics.median(d_rates),
                "generate_tokens_per_s": work / statistics.median(g_times),
                "engine_over_generate": statistics.median(g_times) / statistics.median(e_times),
            }
            print(f"decode b{b}: {json.dumps(decode[f'b{b}'])}", flush=True)
        # a call appending `append` tokens to a cached `context` against a cold prefill of the same call
        ctx, extra = prompt(c.context), prompt(c.append)
        cached_t, cold_t, cached_n = [], [], 0
        # one untimed round first: the first call at these shapes pays one-off costs (a 0.6B model on 2
        # CPU cores took 4.2-4.7 s for its first cached call, 2.6-2.9 s for the next)
        for timed in [False] + [True] * c.repeats:
            engine.call(engine.flush_cache).result(60)
            engine_run(engine, [ctx], 1)  # leaves ctx in the prefix cache
            t, cached_n = engine_run(engine, [ctx + extra], 1)
            engine.call(engine.flush_cache).result(60)
            cold = engine_run(engine, [ctx + extra], 1)[0]
            if timed:
                cached_t.append(t)
                cold_t.append(cold)
        result: dict[str, Any] = {
            "case": asdict(c),
            "parameters": sum(p.numel() for p in model.parameters()),
            "decode": decode,
            "decode_path": {**engine.slot_stats(), "graph_warmup_s": warmup_s},
            "prefix": {
                "cached_call_s": statistics.median(cached_t),
                "cold_prefill_s": statistics.median(cold_t),
                "cached_tokens": cached_n,
            },
            "batch64_over_batch1": decode["b64"]["engine_tokens_per_s"] / decode["b1"]["engine_tokens_per_s"],
            "cached_call_over_cold_prefill": statistics.median(cached_t) / statistics.median(cold_t),
        }
        if device.startswith("cuda"):
            result["bandwidth"] = bandwidth(model, c, decode["b64"]["engine_decode_step_tokens_per_s"])
        return result
    finally:
        engine.shutdown()
        del model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def bandwidth(model: Any, c: Case, decode_tps: float, batch: int = 64) -> dict[str, float]:
    """Decode tokens/s against the bound where each step reads every weight once plus the batch's KV."""
    mc = model.config
    itemsize = next(model.parameters()).element_size()
    weight_bytes = sum(p.numel() for p in model.parameters()) * itemsize
    kv_per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * itemsize
    avg_ctx = c.prompt_len + c.new_tokens / 2
    step_bytes = weight_bytes + batch * avg_ctx * kv_per_token
    bound_tps = batch * H200_BANDWIDTH / step_bytes
    return {
        "weight_bytes": float(weight_bytes),
        "kv_bytes_per_step": float(batch * avg_ctx * kv_per_token),
        "bound_tokens_per_s": bound_tps,
        "measured_decode_tokens_per_s": decode_tps,
        "bandwidth_fraction_b64": decode_tps / bound_tps,
    }


def run_bench(
    quick: bool,
    device: str = "cpu",
    out: str | None = None,
    repeats: int | None = None,
    decode_slots: str = "auto",
    compile_decode: bool = True,
) -> dict[str, Any]:
    results = {}
    for c in cases(quick, device):
        if repeats is not None:
            c = replace(c, repeats=repeats)
        print(f"bench {c.shape} ({c.dtype}) on {device} ...", flush=True)
        results[c.shape] = bench_case(c, device, decode_slots, compile_decode)
        print(json.dumps(results[c.shape]), flush=True)
    main = results[cases(quick, device)[0].shape]
    summary: dict[str, Any] = {
        "device": device if not device.startswith("cuda") else torch.cuda.get_device_name(),
        "quick": quick,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "models": results,
        "batch64_over_batch1": main["batch64_over_batch1"],
        "cached_call_over_cold_prefill": main["cached_call_over_cold_prefill"],
        "engine_over_generate_b64": main["decode"]["b64"]["engine_over_generate"],
    }
    if "bandwidth" in main:
        summary["bandwidth_fraction_b64"] = main["bandwidth"]["bandwidth_fraction_b64"]
    line = json.dumps(summary)
    if out:
        with open(out, "w") as f:
            f.write(json.dumps(summary, indent=2) + "\n")
    print(line, flush=True)
    return summary
