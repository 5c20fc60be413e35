"""The benchmark body (see the package docstring)."""

from __future__ import annotations

import json
import platform
import resource
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gyre_traj import __version__, native
from gyre_traj.io import Codec, encode_msgpack_stream
from gyre_traj.pack import PackConfig, PackItem, pack
from gyre_traj.records import Call
from gyre_traj.select import SelectionConfig, select
from gyre_traj.synth import SynthConfig, synth_execution
from gyre_traj.tree import ExecutionTree, Forest


def _median_time(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def _ingest(stream: bytes) -> ExecutionTree:
    return Forest().add_msgpack(stream).trees["bench"]


def _ingest_vs_copy(stream: bytes, repeats: int) -> tuple[float, float, list[float], ExecutionTree]:
    """Median ingest time of `stream`, median `np.copyto` time of as many bytes, measured alternately in
    one loop so both see the same machine load, and the ratio of each ingest to the copy before it."""
    src = np.frombuffer(stream, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch the destination once: the copy is timed into warm memory
    ingest_t, copy_t = [], []
    tree = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        copy_t.append(time.perf_counter() - t0)
        tree = None  # drop the previous tree first, as a long-running service would have
        t0 = time.perf_counter()
        tree = _ingest(stream)
        ingest_t.append(time.perf_counter() - t0)
    assert tree is not None
    pairs = [i / c for i, c in zip(ingest_t, copy_t, strict=True)]
    return statistics.median(ingest_t), statistics.median(copy_t), pairs, tree


def _ingest_live(frames: list[bytes]) -> ExecutionTree:
    """The live path: one record at a time through `Forest.ingest_frame`, as a trajectory service takes
    them off its socket."""
    forest = Forest()
    for frame in frames:
        forest.ingest_frame(frame)
    return forest.trees["bench"]


def _ingest_live_python(frames: list[bytes]) -> ExecutionTree:
    """The live path with its native half turned off (`gyre_traj.native.use_native(False)`): what an
    install without a C compiler runs."""
    with native.use_native(False):
        return _ingest_live(frames)


def _ingest_plain(frames: list[bytes]) -> ExecutionTree:
    """The same records one at a time through `Forest.add_frame` (each decoded into a `Call`, then
    added): the live path's reference."""
    forest = Forest()
    for frame in frames:
        forest.add_frame(frame)
    return forest.trees["bench"]


@dataclass
class _SideBySide:
    """Medians (and pairwise-ratio quartiles) of the 700k execution's ingests against a copy of its bytes,
    each measured in turn in one loop so that all see the same machine load: the live path
    (`ingest_frame`, its native half in use when built), the same with its native half turned off
    (pure Python), the plain one-record-at-a-time path (`add_frame`: its reference) and the batched
    one; and the live messages copied one at a time, their floor."""

    live_s: float
    live_copy_s: float
    live_message_copy_s: float
    """The same bytes copied one message at a time (a Python loop of slice assignments, each message
    into its place in one buffer): the floor of anything that takes the messages one by one."""
    live_python_s: float
    plain_s: float
    batched_s: float
    batched_copy_s: float
    live_pairs: list[float]
    live_python_pairs: list[float]
    batched_pairs: list[float]
    live_cpu_ratio: float
    live_python_cpu_ratio: float
    batched_cpu_ratio: float
    """The same ratios of medians in this process's CPU time (`time.process_time`), which other jobs on
    the machine inflate less than wall-clock time."""


def _side_by_side(
    frames: list[bytes], batched: bytes, repeats: int
) -> tuple[_SideBySide, ExecutionTree, ExecutionTree]:
    """The figures, and the trees of the last live and batched ingests."""
    live_src = np.frombuffer(b"".join(frames), np.uint8)
    batch_src = np.frombuffer(batched, np.uint8)
    live_dst, batch_dst = np.empty_like(live_src), np.empty_like(batch_src)
    np.copyto(live_dst, live_src)  # touch the destinations once: the copies are timed into warm memory
    np.copyto(batch_dst, batch_src)
    keys = ("live", "live_copy", "live_message_copy", "live_python", "plain", "batched", "batched_copy")
    dst_view = memoryview(live_dst)
    offsets = [0]
    for frame in frames:
        offsets.append(offsets[-1] + len(frame))

    def copy_each() -> None:
        for frame, at in zip(frames, offsets, strict=False):
            dst_view[at : at + len(frame)] = frame

    t: dict[str, list[float]] = {k: [] for k in keys}
    cpu: dict[str, list[float]] = {k: [] for k in t}

    def timed(key: str, fn: Callable[[], Any]) -> Any:
        c0, t0 = time.process_time(), time.perf_counter()
        result = fn()
        t[key].append(time.perf_counter() - t0)
        cpu[key].append(time.process_time() - c0)
        return result

    live_tree = batched_tree = python_tree = None
    for _ in range(repeats):
        live_tree = python_tree = None  # drop the previous trees first, as a long-running service would
        timed("plain", lambda: _ingest_plain(frames))
        timed("live_copy", lambda: np.copyto(live_dst, live_src))
        live_tree = timed("live", lambda: _ingest_live(frames))
        python_tree = timed("live_python", lambda: _ingest_live_python(frames))
        timed("batched_copy", lambda: np.copyto(batch_dst, batch_src))
        batched_tree = None
        batched_tree = timed("batched", lambda: _ingest(batched))
        _ingest_plain(frames)  # (untimed: the messages out of cache, as before the live ingest)
        timed("live_message_copy", copy_each)
    assert live_tree is not None and batched_tree is not None and python_tree is not None
    for name in ("ids", "parent", "depth", "policy", "logprob", "version"):
        if not np.array_equal(getattr(live_tree, name), getattr(python_tree, name)):
            raise AssertionError(
                f"the live path with and without its native half built different trees ({name})"
            )
    if live_tree.calls != python_tree.calls or live_tree.stats != python_tree.stats:
        raise AssertionError("the live path with and without its native half registered different calls")
    med = {k: statistics.median(v) for k, v in t.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    side = _SideBySide(
        live_s=med["live"],
        live_copy_s=med["live_copy"],
        live_message_copy_s=med["live_message_copy"],
        live_python_s=med["live_python"],
        plain_s=med["plain"],
        batched_s=med["batched"],
        batched_copy_s=med["batched_copy"],
        live_pairs=[i / c for i, c in zip(t["live"], t["live_copy"], strict=True)],
        live_python_pairs=[i / c for i, c in zip(t["live_python"], t["live_copy"], strict=True)],
        batched_pairs=[i / c for i, c in zip(t["batched"], t["batched_copy"], strict=True)],
        live_cpu_ratio=med_cpu["live"] / med_cpu["live_copy"],
        live_python_cpu_ratio=med_cpu["live_python"] / med_cpu["live_copy"],
        batched_cpu_ratio=med_cpu["batched"] / med_cpu["batched_copy"],
    )
    return side, live_tree, batched_tree


def _live_peak(
    frames: list[bytes], repeats: int = 3, ingest: Callable[[list[bytes]], Any] = _ingest_live
) -> int:
    """Median over `repeats` of the peak of memory allocated (tracemalloc: Python objects and numpy
    buffers) while the live path ingests `frames`, above what was allocated before it started (the
    frames themselves are the input, not counted)."""
    peaks = []
    for _ in range(repeats):
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        tree = ingest(frames)
        peaks.append(tracemalloc.get_traced_memory()[1] - base)
        tracemalloc.stop()
        del tree
    return int(statistics.median(peaks))


def _quartiles(xs: list[float]) -> list[float]:
    q1, _, q3 = statistics.quantiles(xs, n=4)
    return [round(q1, 2), round(q3, 2)]


def _check_calls(tree: ExecutionTree, calls: list[Call]) -> None:
    """Every call reads back from the live tree as it went in: full input (the delta applied to its
    parent's input + output), output ids and logprobs."""
    full: dict[str, np.ndarray] = {}
    logprob = tree.logprob
    for c in calls:
        if c.input_delta is None:
            assert c.input_ids is not None
            inp = c.input_ids
        else:
            inp = np.concatenate([full[c.input_delta.parent][: c.input_delta.keep], c.input_delta.append])
        full[c.call_id] = np.concatenate([inp, c.output_ids])
        got_in, got_out = tree.call_sequence(c.call_id)
        end = tree.calls[c.call_id].end
        out_nodes = tree.path_nodes(end)[inp.shape[0] :]
        if not (
            np.array_equal(got_in, inp)
            and np.array_equal(got_out, c.output_ids)
            and np.array_equal(logprob[out_nodes], c.output_logprobs)
        ):
            raise AssertionError(f"the live ingest does not give call {c.call_id} back as it went in")


def _native_state() -> str:
    """Whether the live path's native half is in use, in words."""
    if native.in_use():
        return "in use"
    return "built, turned off" if native.BUILT else "not built: pure Python"


def _progress(msg: str) -> None:
    print(f"[gyre-traj bench] {msg}", file=sys.stderr, flush=True)


def run_bench(quick: bool = False, out: str | None = None) -> int:
    cfg = SynthConfig(main_calls=150, max_context=100_000, seed=1) if quick else SynthConfig(seed=1)
    repeats = 3
    delta_repeats = 11 if quick else 31
    _progress(
        f"generating a synthetic execution: {cfg.main_calls} main calls, context up to "
        f"{cfg.max_context:,} tokens, {cfg.compactions} compactions, {cfg.subagents} sub-agents"
    )
    delta_calls = synth_execution(cfg, "bench")
    full_calls = synth_execution(SynthConfig(**{**cfg.__dict__, "delta": False}), "bench")
    delta_stream = encode_msgpack_stream(delta_calls, batch=len(delta_calls))
    per_call_stream = encode_msgpack_stream(delta_calls)
    full_stream = encode_msgpack_stream(full_calls)
    del full_calls
    _progress(
        f"{len(delta_calls)} calls; full records {len(full_stream) / 2**20:,.1f} MiB, "
        f"delta records {len(delta_stream) / 2**20:,.1f} MiB (one call batch), "
        f"{len(per_call_stream) / 2**20:,.1f} MiB (one frame per call)"
    )

    _progress("ingesting full records")
    full_s, full_copy_s, _, tree_full = _ingest_vs_copy(full_stream, repeats)
    _progress(
        f"ingesting delta records: live (one record at a time; native half {_native_state()}; and the "
        f"same in pure Python) and batched, {delta_repeats} rounds"
    )
    codec = Codec()
    frames = [codec.encode_msgpack(c) for c in delta_calls]  # what the proxy sends: one message a call
    live_bytes = sum(map(len, frames))
    side, tree_live, tree = _side_by_side(frames, delta_stream, delta_repeats)
    delta_s, delta_copy_s = side.batched_s, side.batched_copy_s
    per_call_s, per_call_copy_s, _, tree_pc = _ingest_vs_copy(per_call_stream, delta_repeats)
    _progress("peak memory of the live ingest (tracemalloc)")
    live_peak = _live_peak(frames)
    live_python_peak = _live_peak(frames, ingest=_ingest_live_python)
    for other in (tree_full, tree_pc, tree_live):
        for name in ("ids", "parent", "depth", "policy", "logprob", "version"):
            if not np.array_equal(getattr(tree, name), getattr(other, name)):
                raise AssertionError(f"full, per-call and batched records built different trees ({name})")
    _check_calls(tree_live, delta_calls)
    del tree_full, tree_pc, tree_live, full_stream
    fresh = _ingest(delta_stream)
    t0 = time.perf_counter()
    _ = fresh.parent, fresh.logprob  # the per-token arrays derived on first use
    derive_s = time.perf_counter() - t0
    del fresh

    _progress("selecting and packing")
    sel5 = select(tree, SelectionConfig(j_max=5))
    sel_all = select(tree, SelectionConfig(j_max=None))
    budget = 1 << 22
    pack_s, tree_batches = _median_time(
        lambda: pack([PackItem(tree, sel5, 1.0)], PackConfig(token_budget=budget, mode="tree")), repeats
    )
    path_batches = pack([PackItem(tree, sel5, 1.0)], PackConfig(token_budget=budget, mode="paths"))
    tree_tokens = sum(b.num_tokens for b in tree_batches)
    path_tokens = sum(b.num_tokens for b in path_batches)
    call_tokens = tree.stats.call_tokens
    result = {
        "bench": "gyre-traj",
        "version": __version__,
        "quick": quick,
        "python": platform.python_version(),
        "calls": tree.stats.calls,
        "max_context": cfg.max_context,
        "unique_tokens": tree.n,
        "call_expanded_tokens": call_tokens,
        "dedup_ratio": round(call_tokens / tree.n, 2),
        "full_ingest_s": round(full_s, 4),
        "delta_ingest_s": round(delta_s, 4),
        "copy_s": round(full_copy_s, 4),
        "delta_copy_s": round(delta_copy_s, 5),
        "full_over_copy": round(full_s / full_copy_s, 2),
        "delta_over_copy": round(delta_s / delta_copy_s, 2),
        "delta_repeats": delta_repeats,
        "delta_pair_ratio_quartiles": _quartiles(side.batched_pairs),
        "native_built": native.BUILT,
        "native_in_use": native.in_use(),
        "execution_bytes_live": live_bytes,
        "ingest_live_s": round(side.live_s, 4),
        "memcpy_live_s": round(side.live_copy_s, 5),
        "ingest_over_memcpy_700k_live": round(side.live_s / side.live_copy_s, 2),
        "ingest_over_memcpy_700k_live_pair_quartiles": _quartiles(side.live_pairs),
        "memcpy_per_message_live_s": round(side.live_message_copy_s, 5),
        "memcpy_per_message_over_memcpy_live": round(side.live_message_copy_s / side.live_copy_s, 2),
        "ingest_over_memcpy_per_message_live": round(side.live_s / side.live_message_copy_s, 2),
        "ingest_live_python_s": round(side.live_python_s, 4),
        "ingest_over_memcpy_700k_live_python": round(side.live_python_s / side.live_copy_s, 2),
        "ingest_over_memcpy_700k_live_python_pair_quartiles": _quartiles(side.live_python_pairs),
        "ingest_over_memcpy_700k_live_python_cpu": round(side.live_python_cpu_ratio, 2),
        "ingest_plain_s": round(side.plain_s, 4),
        "ingest_over_memcpy_700k_live_plain": round(side.plain_s / side.live_copy_s, 2),
        "ingest_over_memcpy_700k_batched": round(delta_s / delta_copy_s, 2),
        "ingest_over_memcpy_700k_live_cpu": round(side.live_cpu_ratio, 2),
        "ingest_over_memcpy_700k_batched_cpu": round(side.batched_cpu_ratio, 2),
        "ingest_peak_bytes_live": live_peak,
        "ingest_peak_over_bytes": round(live_peak / live_bytes, 3),
        "ingest_peak_bytes_live_python": live_python_peak,
        "ingest_peak_over_bytes_python": round(live_python_peak / live_bytes, 3),
        "ingest_peak_method": "tracemalloc: peak allocated during the live ingest, frames excluded",
        "delta_per_call_ingest_s": round(per_call_s, 4),
        "delta_per_call_copy_s": round(per_call_copy_s, 5),
        "delta_per_call_over_copy": round(per_call_s / per_call_copy_s, 2),
        "derive_arrays_s": round(derive_s, 4),
        "full_tokens_per_s": round(call_tokens / full_s),
        "delta_tokens_per_s": round(call_tokens / delta_s),
        "leaves": len(tree.leaves()),
        "selected_j5_leaves": len(sel5.leaves),
        "loss_tokens_j5": int(sel5.loss_nodes.shape[0]),
        "loss_tokens_all": int(sel_all.loss_nodes.shape[0]),
        "tree_packed_tokens_j5": tree_tokens,
        "path_expanded_tokens_j5": path_tokens,
        "tree_over_path_tokens_j5": round(tree_tokens / max(1, path_tokens), 4),
        "pack_tree_s": round(pack_s, 4),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    _progress(
        f"live ingest / memcpy: {result['ingest_over_memcpy_700k_live']}x with the native half "
        f"({_native_state()}), {result['ingest_over_memcpy_700k_live_python']}x in pure Python"
    )
    line = json.dumps(result)
    if out:
        Path(out).write_text(json.dumps(result, indent=1) + "\n")
    print(line)
    return 0
