"""What a standalone engine and a standalone trainer need to do the work of a `gyre run`, measured on the
same machine after the run: its recorded calls served again, its kept micro-batches trained again, and a
moved call's prefix taken along against prefilled again.

- `recorded_calls`: every call of the run's record log with its whole input (delta inputs resolved),
  output length, times and the engine that served it first.
- `serve_again`: one engine serves a list of calls with exactly their inputs and output lengths (sampled
  at the run's temperature, EOS ignored), each execution's calls in their order (a call starts once the
  execution's previous one is done, so the prefix cache sees what it saw in the run), `concurrency`
  calls in flight at most, the earliest-recorded ready call first. Returns the wall seconds.
- `concurrency_of`: the run's mean number of calls in flight on an engine while it had any.
- `Engines`: standalone `gyre-engine serve` processes with a run's engine options on its first GPU.
- `serve_run_again`: each engine of a run has its recorded calls served again by one standalone engine,
  all at once as they shared the GPU in the run: `rollout_efficiency` = their wall seconds / the run's
  seconds with a call in flight.
- `train_again`: a core alone trains the run's kept steps (`[train] keep_batches`), the first step
  included (compile and allocation are part of the run's time too).
- `migration_vs_reprefill`: two engines; a context cached on the first is handed to the second (device
  to device over CUDA IPC when both are on one GPU, else over gyre-xfer's shared memory), and the next
  call's time to its first token is timed, against the same call after the second engine's cache was
  flushed.
- `decode_vs_context`: where a call's time goes as contexts grow: `batch` calls at once, each a fresh
  context of L tokens, prefilled (one output token), then continued from the cache for `new` tokens;
  the engine's seconds per decode step at each L.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import random
import statistics
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from gyre.config.runconfig import Config
from gyre.procs.group import ProcessGroup, python_argv
from gyre.system import gpus
from gyre_base.ports import free_port


@dataclass(order=True)
class RecordedCall:
    t_start: float
    execution: str = field(compare=False)
    call_id: str = field(compare=False)
    input_ids: list[int] = field(compare=False, repr=False)
    output_len: int = field(compare=False)
    t_end: float = field(compare=False)
    engine: str = field(compare=False)


def recorded_calls(records: Path) -> list[RecordedCall]:
    """Every call of a record log with its whole input (deltas resolved), in start order; ValueError for
    a call whose delta's parent is not in the log."""
    from gyre.measure.prefixes import full_inputs, serving_engine
    from gyre_traj.io import read_records
    from gyre_traj.records import Call

    calls = [r for r in read_records(records) if isinstance(r, Call)]
    inputs = full_inputs(calls)
    missing = [r.call_id for r in calls if r.call_id not in inputs]
    if missing:
        raise ValueError(f"{records}: calls whose delta's parent is not in the log: {missing[:5]}")
    out = [
        RecordedCall(
            r.t_start, r.execution_id, r.call_id, inputs[r.call_id].tolist(), int(r.output_ids.size), r.t_end,
            serving_engine(r) or "0",
        )
        for r in calls
    ]  # fmt: skip
    return sorted(out)


def concurrency_of(calls: list[RecordedCall]) -> tuple[float, float]:
    """(mean calls in flight while any was, seconds with any in flight) over these calls' intervals."""
    spans = sorted((c.t_start, c.t_end) for c in calls)
    busy = 0.0
    lo, hi = None, None
    for a, b in spans:
        if hi is None or a > hi:
            if hi is not None and lo is not None:
                busy += hi - lo
            lo, hi = a, b
        else:
            hi = max(hi, b)
    if hi is not None and lo is not None:
        busy += hi - lo
    total = sum(b - a for a, b in spans)
    return (total / busy if busy > 0 else 0.0), busy


async def serve_again(
    url: str, calls: list[RecordedCall], concurrency: int, temperature: float
) -> dict[str, Any]:
    from gyre_engine.client import EngineClient
    from gyre_engine.protocol import SamplingParams

    chains: dict[str, list[RecordedCall]] = {}
    for c in sorted(calls):
        chains.setdefault(c.execution, []).append(c)
    ready: list[tuple[float, int, str]] = []
    seq = itertools.count()
    for ex, chain in chains.items():
        heapq.heappush(ready, (chain[0].t_start, next(seq), ex))
    nxt = dict.fromkeys(chains, 0)
    left = len(calls)
    cond = asyncio.Condition()
    cached = [0, 0]  # cached input tokens, input tokens

    async def worker(c: Any) -> None:
        nonlocal left
        while True:
            async with cond:
                while not ready and left > 0:
                    await cond.wait()
                if not ready:
                    return
                _, _, ex = heapq.heappop(ready)
                call = chains[ex][nxt[ex]]
            sp = SamplingParams(max_new_tokens=call.output_len, temperature=temperature, ignore_eos=True)
            r = await c.generate(call.input_ids, sp, return_logprob=True)
            if len(r.output_ids) != call.output_len:  # EOS ignored: anything else is not the run's work
                raise RuntimeError(
                    f"call {call.call_id} served {len(r.output_ids)} tokens again, {call.output_len} in the run"
                )
            cached[0] += int(r.meta_info.cached_tokens or 0)
            cached[1] += len(call.input_ids)
            async with cond:
                left -= 1
                nxt[ex] += 1
                if nxt[ex] < len(chains[ex]):
                    heapq.heappush(ready, (chains[ex][nxt[ex]].t_start, next(seq), ex))
                cond.notify_all()

    async with EngineClient(url, timeout_s=900.0) as client:
        before = await client.server_info()
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(max(1, concurrency))))
        wall = time.perf_counter() - t0
        after = await client.server_info()
    return {
        "calls": len(calls),
        "concurrency": concurrency,
        "wall_s": round(wall, 3),
        "output_tokens": sum(c.output_len for c in calls),
        "prefix_cache_hit_share": round(cached[0] / cached[1], 4) if cached[1] else None,
        "engine": engine_work(before, after),
    }


def engine_work(before: Any, after: Any) -> dict[str, Any]:
    """What a standalone engine did between two `/server_info` replies, in the keys of the run's
    `engine_time` (decode steps and rows a step, prefill passes and their milliseconds), so the replay and
    the run can be read side by side."""
    steps = after.decode_steps - before.decode_steps
    passes = after.prefill_passes - before.prefill_passes
    decode_s = after.decode_time_s - before.decode_time_s
    prefill_s = after.prefill_time_s - before.prefill_time_s
    return {
        "decode_s": round(decode_s, 3),
        "prefill_s": round(prefill_s, 3),
        "decode_steps": steps,
        "decode_ms_per_step": round(1000 * decode_s / steps, 3) if steps else None,
        "mean_decode_batch": round((after.decode_tokens - before.decode_tokens) / steps, 2)
        if steps
        else None,
        "prefill_passes": passes,
        "prefill_graph_passes": after.prefill_graph_passes - before.prefill_graph_passes,
        "prefill_ms_per_pass": round(1000 * prefill_s / passes, 2) if passes else None,
    }


class Engines:
    """Standalone `gyre-engine serve` processes with the run's engine options, on the run's first GPU."""

    def __init__(
        self,
        cfg: Config,
        model_dir: Path,
        logs: Path,
        n: int,
        extra: list[list[str]] | None = None,
        name: str = "engine-alone",
    ) -> None:
        """`n` engines with the run's options; `extra`: more options for each (later ones win); logs
        under `name`-i."""
        self.procs = ProcessGroup(logs)
        self.urls = []
        self.t0 = time.monotonic()
        for i in range(n):
            port = free_port()
            more = extra[i] if extra else []
            argv = python_argv("gyre_engine", "serve", "--model", str(model_dir), "--port", str(port),
                               "--device", cfg.cell.device, *gpus.engine_argv(cfg), *more)  # fmt: skip
            self.procs.start(f"{name}-{i}", argv, env={"OMP_NUM_THREADS": "1", **gpus.cell_env(cfg, 0)})
            self.urls.append(f"http://127.0.0.1:{port}")
        self.cfg = cfg

    def wait(self) -> float:
        from gyre_engine.client import EngineClient

        async def up(url: str) -> None:
            async with EngineClient(url, timeout_s=10.0) as c:
                while True:
                    self.procs.check()
                    try:
                        if await c.health(timeout=5.0):
                            return
                    except Exception:
                        pass
                    if time.monotonic() - self.t0 > self.cfg.run.startup_timeout_s:
                        raise TimeoutError("standalone engine not healthy in time")
                    await asyncio.sleep(0.3)

        async def all_up() -> None:
            await asyncio.gather(*(up(u) for u in self.urls))

        asyncio.run(all_up())
        return time.monotonic() - self.t0

    def close(self) -> None:
        self.procs.close()


def bounded[T](coro: Coroutine[Any, Any, T], deadline: float) -> T:
    """Run `coro` to its end, or fail with TimeoutError at `deadline` (time.monotonic), so a stuck engine
    costs the part it is in, not the results of the whole call."""
    return asyncio.run(asyncio.wait_for(coro, max(1.0, deadline - time.monotonic())))


def serve_run_again(
    cfg: Config, urls: list[str], calls: list[RecordedCall], metrics: dict[str, Any], deadline: float
) -> dict[str, Any]:
    """`rollout_efficiency` = the seconds standalone engines sharing the GPU take to serve a run's
    recorded `calls` (`recorded_calls`; each run engine's calls on one of them, same inputs, output
    lengths and in-run mean concurrency, all at once) / the run's seconds with a call in flight on any
    engine (the union of the recorded calls' intervals, as the proxy timed them); TimeoutError past
    `deadline`.

    `rollout_efficiency_sampled` holds the same seconds to the run's sampled busy rollout GPU-seconds
    (metrics.json): a sample interval counts whole when its engine was busy at either end, which for calls
    much shorter than the interval with idle time between them (a workload of short calls and tool time)
    counts up to two intervals a call. Where the engines never wait for calls the two agree."""
    by_engine: dict[str, list[RecordedCall]] = {}
    for c in calls:
        by_engine.setdefault(c.engine, []).append(c)
    engines = sorted(by_engine)
    in_run = {e: concurrency_of(by_engine[e]) for e in engines}  # (mean in flight, busy seconds)

    async def both() -> list[dict[str, Any]]:
        jobs = []
        for url, e in zip(urls, engines, strict=False):
            jobs.append(serve_again(url, by_engine[e], max(1, round(in_run[e][0])), cfg.agent.temperature))
        return list(await asyncio.gather(*jobs))

    t0 = time.monotonic()
    got = bounded(both(), deadline)
    wall = time.monotonic() - t0
    per = {}
    for e, r in zip(engines, got, strict=False):
        conc, busy = in_run[e]
        per[e] = {**r, "run_concurrency": round(conc, 2), "run_busy_s": round(busy, 3)}
    _, in_flight = concurrency_of(calls)
    dev = metrics.get("efficiency", {}).get("device_seconds", {})
    busy = dev.get("rollout_busy_s")
    return {
        "per_engine": per,
        "standalone_s": round(wall, 3),
        "calls_in_flight_s": round(in_flight, 3),
        "rollout_busy_gpu_s": busy,
        "rollout_busy_cell_s": metrics.get("roles", {}).get("cell_seconds", {}).get("rollout_busy_s"),
        "rollout_efficiency": round(wall / in_flight, 4) if in_flight > 0 else None,
        "rollout_efficiency_sampled": round(wall / busy, 4) if busy else None,
        "run_partial": metrics.get("partial"),  # a run cut at its deadline: the calls it recorded
    }


def train_again(
    model_dir: Path, batches: Path, device: str, token_budget: int, lr: float, chunk_budget: int = 0
) -> dict[str, Any]:
    """A core alone (the run's model, attention, budgets and, on a GPU, the warm-up its cells do at
    start-up) trains every kept step in order; seconds per step (the first included) and in all."""
    import torch
    from gyre_train import batchlog
    from gyre_train.core import Core, CoreConfig, OptimConfig
    from gyre_train.defaults import warmup_rounds
    from gyre_train.model import Attention, build_model, load_pretrained
    from gyre_train.modelconfig import ModelConfig

    steps = batchlog.read_steps(batches)
    if not device.startswith("cuda"):
        torch.set_num_threads(1)  # as the run's cells (OMP_NUM_THREADS=1): two threads on two busy cores
        # made a micro-batch 25x slower here
    mc = ModelConfig.from_model_dir(model_dir)
    attention: Attention = "flex" if device.startswith("cuda") else "dense"
    model = build_model(mc, attention, device)
    load_pretrained(model, mc, model_dir)
    core = Core(
        model,
        mc,
        CoreConfig(
            attention=attention,
            token_budget=token_budget,
            chunk_budget=chunk_budget,
            optim=OptimConfig(lr=lr),
            mismatch_warn=0.0,  # it times the run's steps on weights that need not be the run's (a call
            # that measures another call's archives starts from the model without its warm start)
        ),
    )
    per_step = []
    try:
        core.warm_up(warmup_rounds(torch.device(device).type))  # as the run's cells do: not in a step
        for _, mbs in steps:
            t0 = time.perf_counter()
            core.train_step(mbs)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            per_step.append(round(time.perf_counter() - t0, 3))
    finally:
        core.close()
        del model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return {
        "steps": len(steps),
        "microbatches": sum(len(m) for _, m in steps),
        "tokens": sum(int(b.input_ids.size) for _, m in steps for b in m),
        "step_s": per_step,
        "total_s": round(sum(per_step), 3),
    }


async def migration_vs_reprefill(
    a: str, b: str, contexts: list[int], reps: int, vocab: int, transport: str = "cuda_ipc"
) -> dict[str, Any]:
    """Per context length: the median seconds to a moved call's first token with its prefix handed from
    engine `a` to engine `b` (offer, pull, install, then the call), and the same call on `b` with its
    cache flushed (prefilled again); also the hand-off alone, and the way the KV went (`transport`:
    "cuda_ipc" when both engines are on one GPU, else "shm", which `handoff_prefix` falls back to; or
    what `transport` names)."""
    from gyre_engine.client import EngineClient, handoff_prefix
    from gyre_engine.protocol import PrefixTransport, SamplingParams

    way = cast(PrefixTransport, transport)
    one = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    out: dict[str, Any] = {}
    async with EngineClient(a, timeout_s=600) as ca, EngineClient(b, timeout_s=600) as cb:
        warm = [random.Random(0).randrange(10, vocab) for _ in range(256)]
        await ca.generate(warm, one)
        await handoff_prefix(ca, cb, warm, transport=way)  # transports opened before timing
        for n in contexts:
            rng = random.Random(n)
            moved, again, hand = [], [], []
            went: set[str] = set()
            for r in range(reps):
                ids = [rng.randrange(10, vocab) for _ in range(n)]
                call = [*ids, rng.randrange(10, vocab)]
                await ca.generate(ids, one)  # the drained engine holds the context
                await cb.flush_cache()
                t0 = time.perf_counter()
                reply = await handoff_prefix(ca, cb, ids, transport=way)
                t1 = time.perf_counter()
                assert reply is not None and reply.success, "the prefix was not handed over"
                went.add(reply.transport)
                got = await cb.generate(call, one)
                t2 = time.perf_counter()
                assert (got.meta_info.cached_tokens or 0) >= 0.9 * n, "the moved prefix was not used"
                await cb.flush_cache()
                t3 = time.perf_counter()
                await cb.generate(call, one)
                t4 = time.perf_counter()
                if r:  # the first round of each length captures its shapes
                    moved.append(t2 - t0)
                    hand.append(t1 - t0)
                    again.append(t4 - t3)
            out[str(n)] = {
                "ttft_migrated_s": round(statistics.median(moved), 4),
                "handoff_s": round(statistics.median(hand), 4),
                "ttft_reprefill_s": round(statistics.median(again), 4),
                "speedup": round(statistics.median(again) / statistics.median(moved), 2),
                "transport": ",".join(sorted(went)),
            }
    return out


async def decode_vs_context(url: str, lengths: list[int], batch: int, new: int, vocab: int) -> dict[str, Any]:
    """Per context length L: `batch` fresh contexts of L tokens at once, prefilled with one output token
    (`prefill_s`, the wall of the batch), then the same contexts plus that token continued from the
    prefix cache for `new` tokens (`decode_s`; `step_ms` = its wall / `new`, `tok_s` = batch x new / its
    wall, `cached_share` = the continued calls' cached input tokens / their input tokens, and the engine's
    counters over the decode part: decode and prefill seconds, CUDA graphs captured and their seconds)."""
    from gyre_engine.client import EngineClient
    from gyre_engine.protocol import SamplingParams

    one = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    more = SamplingParams(max_new_tokens=new, temperature=1.0, ignore_eos=True)
    out: dict[str, Any] = {}
    async with EngineClient(url, timeout_s=600) as c:
        await c.generate([11, 12, 13], one)
        for n in lengths:
            rng = random.Random(n)
            ctxs = [[rng.randrange(10, vocab) for _ in range(n)] for _ in range(batch)]
            await c.flush_cache()
            t0 = time.perf_counter()
            firsts = await asyncio.gather(*(c.generate(x, one) for x in ctxs))
            t1 = time.perf_counter()
            before = await c.server_info()
            calls = [[*x, f.output_ids[0]] for x, f in zip(ctxs, firsts, strict=True)]
            got = await asyncio.gather(*(c.generate(x, more) for x in calls))
            t2 = time.perf_counter()
            after = await c.server_info()
            cached = sum(int(g.meta_info.cached_tokens or 0) for g in got)
            out[str(n)] = {
                "batch": batch,
                "prefill_s": round(t1 - t0, 4),
                "decode_s": round(t2 - t1, 4),
                "step_ms": round(1000 * (t2 - t1) / new, 2),
                "tok_s": round(batch * new / (t2 - t1), 1),
                "cached_share": round(cached / sum(len(x) for x in calls), 4),
                # the engine's own counters over the decode part: its decode and prefill seconds, and
                # the CUDA graphs it captured on the way (first use of a batch or length bucket)
                "engine_decode_s": round(after.decode_time_s - before.decode_time_s, 4),
                "engine_prefill_s": round(after.prefill_time_s - before.prefill_time_s, 4),
                "graph_captures": after.graph_captures - before.graph_captures,
                "graph_capture_s": round(after.graph_capture_s - before.graph_capture_s, 4),
                "slot_grows": after.slot_grows - before.slot_grows,
                "reserved_gib": round(after.device_reserved_bytes / 2**30, 2),
                "peak_reserved_gib": round(after.device_peak_reserved_bytes / 2**30, 2),
                "allocated_gib": round(after.device_allocated_bytes / 2**30, 2),
            }
    return out
