"""How well a run used its machines, from what it recorded: the cells' start-up, each engine's share of
the calls, the prefix cache's hits beside their ideal (`prefixes`), the longest context, the busy
seconds of each device, and how each engine spent its busy rollout time (`engine_time`: decode and
prefill seconds, rows per decode step, requests queued).

Read after the run from the run directory (`cells/<id>.startup.json`, the proxy's records with their
`engines` and `cached_tokens` metadata) and the sampler's readings. Device seconds count a device once
however many cells share it: two cells on one GPU that are both busy in rollout are one busy GPU-second
per second, not two, which is the time a standalone engine or trainer on that GPU is compared with
(`integration/bench/h200_agentic.py`). Cells on the CPU share one device.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from gyre_sched.protocol import Role
from gyre_traj.records import Call

from gyre.config.runconfig import Config
from gyre.measure import prefixes
from gyre.measure.samples import Sample, busy_between
from gyre.measure.trainwatch import TrainTrack


def startup(out: Path) -> dict[str, Any]:
    """Per cell: seconds from launching its engine to the trainer side being ready and to the engine
    answering, and its engine's first weight pull at start-up; `engines_started_together`: every engine
    was launched before the first one was up."""
    recs = []
    for p in sorted((out / "cells").glob("*.startup.json")):
        recs.append(json.loads(p.read_text()))
    if not recs:
        return {}
    per_cell = {
        str(r["cell"]): {
            "engine_s": round(r["engine_ready"] - r["engine_launched"], 3),
            "trainer_s": round(r["trainer_ready"] - r["engine_launched"], 3),
            "first_pull_s": r.get("first_pull_s"),
        }
        for r in recs
    }
    first_up = min(r["engine_ready"] for r in recs)
    return {
        "per_cell": per_cell,
        "engine_startup_s": [per_cell[str(r["cell"])]["engine_s"] for r in recs],
        "engines_started_together": all(r["engine_launched"] < first_up for r in recs),
        "all_up_s": round(max(r["engine_ready"] for r in recs) - min(r["engine_launched"] for r in recs), 3),
    }


def input_lengths(records: Iterable[Call]) -> list[tuple[Call, int]]:
    """Each call with the length of its input (a delta-encoded input is its parent's kept part plus what
    it appends)."""
    out = []
    for r in records:
        if r.input_ids is not None:
            n = int(r.input_ids.size)
        else:
            assert r.input_delta is not None
            n = r.input_delta.keep + int(r.input_delta.append.size)
        out.append((r, n))
    return out


def calls_and_cache(calls: Sequence[tuple[Call, int]]) -> dict[str, Any]:
    """Input tokens, those the first engine found in its prefix cache, and the longest context."""
    inp = sum(n for _, n in calls)
    cached = sum(int(r.metadata.get("cached_tokens", 0)) for r, _ in calls)
    return {
        "calls": len(calls),
        "input_tokens": inp,
        "cached_tokens": cached,
        "prefix_cache_hit_share": round(cached / inp, 4) if inp else None,
        "context_tokens_max": max((n + int(r.output_ids.size) for r, n in calls), default=0),
        "output_tokens": sum(int(r.output_ids.size) for r, _ in calls),
    }


def engine_call_share(calls: Sequence[tuple[Call, int]], samples: Sequence[Sample]) -> dict[str, Any]:
    """Each engine's share of the calls that began while every cell was in rollout (a call's engine is
    the first that served it)."""
    spans = _all_rollout_spans(samples)
    counts: dict[str, int] = {}
    for r, _ in calls:
        first = prefixes.serving_engine(r)
        if not first or not any(a <= r.t_start < b for a, b in spans):
            continue
        counts[first] = counts.get(first, 0) + 1
    n = sum(counts.values())
    cells = sorted({str(c) for s in samples for c in s.roles})
    return {
        "engine_call_share": {c: round(counts.get(c, 0) / n, 4) for c in cells} if n else {},
        "calls_while_all_rollout": n,
    }


def _all_rollout_spans(samples: Sequence[Sample]) -> list[tuple[float, float]]:
    out = []
    for prev, cur in itertools.pairwise(samples):
        if prev.roles and all(r == int(Role.ROLLOUT) for r in prev.roles.values()):
            out.append((prev.t, cur.t))
    return out


def device_of(cfg: Config) -> dict[int, str]:
    """The device each cell runs on: its GPU (`[cell] gpus`, else cell i on GPU i), or one CPU."""
    n = cfg.run.cells
    if cfg.cell.device != "cuda":
        return {i: "cpu" for i in range(n)}
    gpus = cfg.cell.gpus or list(range(n))
    return {i: f"cuda:{gpus[i]}" for i in range(n)}


def device_seconds(
    samples: Sequence[Sample], track: TrainTrack, devices: dict[int, str], t0: float, t1: float
) -> dict[str, Any]:
    """Per device: seconds in which any of its cells was busy in rollout (its engine running or queueing
    a request) and busy in training (in the training role while the core's step had work); and the same
    summed over devices."""
    per: dict[str, dict[str, float]] = {}
    for prev, cur in itertools.pairwise(samples):
        a, b = max(prev.t, t0), min(cur.t, t1)
        if b <= a:
            continue
        roll: set[str] = set()
        train: set[str] = set()
        for cid, role in prev.roles.items():
            dev = devices.get(cid, "cpu")
            if role == int(Role.ROLLOUT) and (busy_between(prev, cur, cid)):
                roll.add(dev)
            elif role == int(Role.TRAINING):
                train.add(dev)
        busy_train = track.busy_s(a, b) if train else 0.0
        for dev in roll | train:
            acc = per.setdefault(dev, {"rollout_busy_s": 0.0, "training_busy_s": 0.0})
            if dev in roll:
                acc["rollout_busy_s"] += b - a
            if dev in train:
                acc["training_busy_s"] += busy_train
    tot = {k: round(sum(d[k] for d in per.values()), 3) for k in ("rollout_busy_s", "training_busy_s")}
    return {
        "per_device": {d: {k: round(v, 3) for k, v in acc.items()} for d, acc in sorted(per.items())},
        **tot,
    }


COUNTERS = (
    "decode_steps", "decode_tokens", "decode_s", "prefill_tokens", "prefill_s", "evicted_tokens",
    "host_spilled_tokens", "host_hit_tokens", "step_s", "command_s", "graph_captures", "graph_capture_s",
    "prefill_passes", "prefill_graph_passes",
)  # fmt: skip


def engine_time(samples: Sequence[Sample], t0: float, t1: float) -> dict[str, dict[str, Any]]:
    """Per engine, over the samples in [t0, t1] in which its cell was in rollout: how its busy rollout
    time went, from the growth of its cumulative counters between two samples (a counter that fell
    counts from zero: the engine restarted). `computing_share` = (decode + prefill seconds of the engine
    thread) / busy rollout seconds (the rest: the engine thread idle while a request waits or streams,
    graph captures, prefix copies, the process's own overhead); `decode_ms_per_step`, `mean_decode_batch`
    (rows per decode step), `decode_tok_s`, `prefill_tok_s`, `mean_waiting` (requests queued for
    admission, averaged over rollout time), `evicted_tokens` (cached prefix tokens the engine dropped, or
    moved to its host tier, to keep memory free), `host_spilled_tokens` and `host_hit_tokens` (prefix
    tokens it copied to its host tier, and served from there instead of computing them), `step_s` and
    `command_s` (the engine thread in its steps, and on calls from the server's other threads),
    `graph_captures` and `graph_capture_s` (decode steps captured as CUDA graphs while serving, and
    their seconds: each holds every running row), `prefill_passes` and `prefill_ms_per_pass` (prefill
    forward passes, and their mean seconds: calls extending cached contexts admitted together share one),
    `prefill_graph_passes` (of those, packed passes replayed as a CUDA graph into the decode slots),
    `step_other_s` (step seconds outside decode and prefill: admission's lookups and claims, prefixes
    stored, copies to the host tier) and `idle_s` (busy rollout seconds with the engine thread in neither:
    waiting for a request's turn, or the process's own overhead); `waiting_by_reason` (requests waiting,
    averaged over rollout time, by what held them at admission: gyre-engine's `waiting_s`, over the
    engine's steps); None where it does not count them. Engines that report no counters are left out."""
    acc: dict[int, dict[str, float]] = {}
    counted: dict[int, set[str]] = {}  # the counters each engine reported
    held: dict[int, dict[str, float]] = {}  # request-seconds waiting, by reason
    for prev, cur in itertools.pairwise(samples):
        a, b = max(prev.t, t0), min(cur.t, t1)
        if b <= a:
            continue
        for cid, role in prev.roles.items():
            p, c = prev.engine_counters.get(cid), cur.engine_counters.get(cid)
            if role != int(Role.ROLLOUT) or p is None or c is None:
                continue
            e = acc.setdefault(cid, dict.fromkeys((*COUNTERS, "rollout_s", "busy_s", "waiting_s"), 0.0))
            for k in COUNTERS:
                x, y = p.get(k), c.get(k)
                if x is None or y is None:
                    continue
                counted.setdefault(cid, set()).add(k)
                e[k] += _grown(x, y)
            e["rollout_s"] += b - a
            e["waiting_s"] += float(p.get("waiting") or 0.0) * (b - a)
            wp, wc = p.get("waiting_s"), c.get("waiting_s")
            if isinstance(wp, dict) and isinstance(wc, dict):
                w = held.setdefault(cid, {})
                for why, y in wc.items():
                    x = float(wp.get(why, 0.0))
                    w[why] = w.get(why, 0.0) + _grown(x, float(y))
            if busy_between(prev, cur, cid):
                e["busy_s"] += b - a

    def ratio(x: float, y: float, scale: float = 1.0, nd: int = 3) -> float | None:
        return round(scale * x / y, nd) if y > 0 else None

    out: dict[str, dict[str, Any]] = {}
    for cid, e in sorted(acc.items()):
        has = counted.get(cid, set())
        prefill_s = e["prefill_s"] if "prefill_s" in has else None
        out[str(cid)] = {
            "rollout_busy_s": round(e["busy_s"], 3),
            "decode_s": round(e["decode_s"], 3),
            "prefill_s": None if prefill_s is None else round(prefill_s, 3),
            "computing_share": ratio(e["decode_s"] + (prefill_s or 0.0), e["busy_s"], nd=4),
            "decode_steps": int(e["decode_steps"]),
            "decode_ms_per_step": ratio(e["decode_s"], e["decode_steps"], 1000.0),
            "mean_decode_batch": ratio(e["decode_tokens"], e["decode_steps"], nd=2),
            "decode_tok_s": ratio(e["decode_tokens"], e["decode_s"], nd=1),
            "prefill_tokens": int(e["prefill_tokens"]),
            "prefill_tok_s": None if prefill_s is None else ratio(e["prefill_tokens"], prefill_s, nd=1),
            "prefill_passes": int(e["prefill_passes"]) if "prefill_passes" in has else None,
            "prefill_ms_per_pass": (
                ratio(prefill_s, e["prefill_passes"], 1000.0, nd=2)
                if prefill_s is not None and "prefill_passes" in has
                else None
            ),
            "prefill_graph_passes": int(e["prefill_graph_passes"]) if "prefill_graph_passes" in has else None,
            "mean_waiting": ratio(e["waiting_s"], e["rollout_s"], nd=2),
            **{
                k: int(e[k]) if k in has else None
                for k in ("evicted_tokens", "host_spilled_tokens", "host_hit_tokens", "graph_captures")
            },
            "graph_capture_s": round(e["graph_capture_s"], 3) if "graph_capture_s" in has else None,
            **_thread_time(e, has, prefill_s),
            "waiting_by_reason": (
                {why: ratio(x, e["rollout_s"], nd=2) for why, x in sorted(held[cid].items())}
                if cid in held
                else None
            ),
        }
    return out


def _grown(x: float, y: float) -> float:
    """How much a cumulative counter grew from `x` to `y` (from zero when it fell: the engine restarted)."""
    return y - x if y >= x else y


def _thread_time(e: dict[str, float], has: set[str], prefill_s: float | None) -> dict[str, float | None]:
    """`engine_time`'s split of the engine thread's busy rollout time (see there)."""
    if not {"step_s", "command_s"} <= has:
        return dict.fromkeys(("step_s", "command_s", "step_other_s", "idle_s"))
    other = e["step_s"] - e["decode_s"] - (prefill_s or 0.0)
    return {
        "step_s": round(e["step_s"], 3),
        "command_s": round(e["command_s"], 3),
        "step_other_s": round(max(0.0, other), 3),
        "idle_s": round(max(0.0, e["busy_s"] - e["step_s"] - e["command_s"]), 3),
    }


def efficiency(
    cfg: Config, out: Path, records: Iterable[Call], samples: Sequence[Sample], track: TrainTrack, t0: float,
    t1: float,
) -> dict[str, Any]:  # fmt: skip
    """The `efficiency` entry of metrics.json."""
    recs = list(records)
    calls = input_lengths(recs)
    hits = prefixes.prefix_hits(recs)
    return {
        "startup": startup(out),
        **calls_and_cache(calls),
        "prefix_cache_hit_share_ideal": hits["prefix_cache_hit_share_ideal"],
        "prefix_cache": {k: v for k, v in hits.items() if not k.startswith("prefix_cache_hit_share")}
        | {
            "hit_share_own_engine": hits["prefix_cache_hit_share_own_engine"],
            "hit_share_any_version": hits["prefix_cache_hit_share_any_version"],
        },
        **engine_call_share(calls, samples),
        "device_seconds": device_seconds(samples, track, device_of(cfg), t0, t1),
        "engine_time": engine_time(samples, t0, t1),
    }
