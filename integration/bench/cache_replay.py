"""Replay a run's recorded calls through gyre-engine's prefix cache, to say what hit share other cache
sizes would have found on the same calls.

A run archive's `records.msgpack` holds every call: its engine, its whole input (resolved from the deltas),
its output, its weight version and when it started and ended. This script replays them in time order, per
engine, through the engine's own `PrefixCache` (the class the engine steps, with its LRU, its host tier in
one `HostArena` and its long-slot entries), holding one number of KV per token instead of the model's:
- a call starts: the cache's longest prefix of its input (at most its input less one) is its hit; a call
  whose context and longest output pass a decode slot's width takes a long slot the way the engine does (the
  slot its hit is when the call extends that slot's whole context, else an idle one no entry holds, else
  the idle one used least recently, whose context goes to the host tier);
- a call ends: its input and output less the last token go into the cache, as the engine stores a finished
  row (a long slot's row stays in its slot);
- an engine's first call of a new weight version finds its cache cleared (the engine drops it at a switch
  and at an update).

What it leaves out, and so where its figure is the higher: a call's wait in the engine's queue (it looks up
at arrival, not at admission), and evictions for the GPU's free memory (`min_free_gib`), which the records
do not hold. The replay at the run's own sizes is printed beside the run's measured hits, which says how
far these matter.

    uv run python integration/bench/cache_replay.py .runs/run-elastic.tar.xz \
        --host-tokens 0,65536,131072,196608,262144,1048576 --out integration/bench/results-cache-replay.json
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gyre.measure.prefixes import full_inputs, serving_engine
from gyre.trajsvc import recordlog
from gyre_engine.server.batch import RowKV, buffer_row
from gyre_engine.server.prefix_cache import PrefixCache, PrefixHit
from gyre_traj.records import Call

DTYPE = torch.bfloat16


@dataclass
class Sizes:
    """One engine's cache sizes, in tokens (the engine's settings of the same names)."""

    max_cached_tokens: int
    host_cached_tokens: int
    slot_tokens: int
    """A decode slot's width: a call whose context and longest output pass it takes a long slot."""
    long_context_tokens: int
    long_context_slots: int
    max_new_tokens: int = -1
    """The calls' `max_new_tokens` (the records do not hold it); -1: each call's own output length, which
    is what the profile harness asks for."""

    def label(self) -> str:
        return (
            f"device {self.max_cached_tokens} + host {self.host_cached_tokens} + "
            f"{self.long_context_slots} long slots"
        )


@dataclass
class _Engine:
    sizes: Sizes
    cache: PrefixCache = field(init=False)
    buf: torch.Tensor = field(init=False)
    busy: set[int] = field(default_factory=set)
    version: int | None = None

    def __post_init__(self) -> None:
        s = self.sizes
        self.cache = PrefixCache(s.max_cached_tokens, s.host_cached_tokens)
        # the long slots' buffer, [2, layers, rows, kv_heads, capacity, head_dim], with one of each
        self.buf = torch.zeros(2, 1, max(1, s.long_context_slots), 1, s.long_context_tokens, 1, dtype=DTYPE)
        self.cache.reserve_host(_kv(1).nbytes())

    def claim_long(self, hit: PrefixHit) -> int | None:
        """The long slot a call takes (`PrefixCache.take_long_slot`, as the engine), None when none is
        idle."""
        idle = [s for s in range(self.sizes.long_context_slots) if s not in self.busy]
        if not idle:
            return None
        slot, _ = self.cache.take_long_slot(self.buf, idle, hit)
        self.busy.add(slot)
        return slot


def _kv(n: int) -> RowKV:
    return RowKV([torch.zeros(1, 1, n, 1, dtype=DTYPE)], [torch.zeros(1, 1, n, 1, dtype=DTYPE)])


def load_records(archive: Path) -> list[Call]:
    """The calls of a run archive (`run-<policy>.tar.xz`) or of a run folder's `records.msgpack`."""
    if archive.is_dir():
        return [c for _, c in recordlog.calls(archive / "records.msgpack")]
    with tempfile.TemporaryDirectory() as tmp, tarfile.open(archive) as tar:
        member = next((m for m in tar.getmembers() if Path(m.name).name == "records.msgpack"), None)
        if member is None:
            raise SystemExit(f"{archive}: no records.msgpack in the archive")
        tar.extract(member, tmp, filter="data")
        return [c for _, c in recordlog.calls(Path(tmp) / member.name)]


def replay(records: list[Call], sizes: Sizes) -> dict[str, Any]:
    """The hits the cache of `sizes` finds on `records`, per engine and in all (see the module docstring)."""
    inputs = full_inputs(records)
    recs = [r for r in records if r.call_id in inputs]
    # events: (time, 0 for an end / 1 for a start, order, call); ends first at the same time
    events = [(r.t_start, 1, i, r) for i, r in enumerate(recs)] + [
        (r.t_end, 0, i, r) for i, r in enumerate(recs)
    ]
    heapq.heapify(events)
    engines: dict[str, _Engine] = {}
    slot_of: dict[str, int] = {}
    tot: dict[str, dict[str, int]] = {}
    while events:
        _, kind, _, r = heapq.heappop(events)
        name = serving_engine(r)
        e = engines.get(name)
        if e is None:
            e = engines[name] = _Engine(sizes)
        x = inputs[r.call_id]
        n = int(x.size)
        t = tot.setdefault(name, {"calls": 0, "input_tokens": 0, "hit_tokens": 0, "measured": 0,
                                  "host_hits": 0, "long_waits": 0})  # fmt: skip
        if kind == 1:
            if e.version != r.weight_version:
                e.cache.clear()
                e.version = r.weight_version
            hit = e.cache.lookup(x, limit=max(0, n - 1))
            e.cache.used(hit)
            t["calls"] += 1
            t["input_tokens"] += n
            t["hit_tokens"] += hit.length
            t["host_hits"] += hit.length if hit.on_host else 0
            t["measured"] += min(n, int(r.metadata.get("cached_tokens", 0)))
            new = sizes.max_new_tokens if sizes.max_new_tokens >= 0 else int(r.output_ids.size)
            if sizes.long_context_slots and n + new > sizes.slot_tokens:
                slot = e.claim_long(hit)
                if slot is None:
                    t["long_waits"] += 1
                else:
                    slot_of[r.call_id] = slot
            continue
        whole = np.concatenate([x, np.asarray(r.output_ids)])[:-1]
        slot = slot_of.pop(r.call_id, None)
        if slot is not None:
            e.busy.discard(slot)  # free again, whatever it leaves in the cache
        if e.version != r.weight_version or whole.size == 0:
            continue  # the cache was cleared for a newer version while the call ran
        if slot is not None:
            kv: RowKV = buffer_row(e.buf, min(int(whole.size), sizes.long_context_tokens), slot)
            e.cache.insert(whole[: kv.length].tolist(), kv, owned=True)
        else:
            e.cache.insert(whole.tolist(), _kv(int(whole.size)), owned=True)
    per = {
        k: {**v, "hit_share": round(v["hit_tokens"] / v["input_tokens"], 4) if v["input_tokens"] else None}
        for k, v in sorted(tot.items())
    }
    inp = sum(v["input_tokens"] for v in tot.values())
    return {
        "sizes": sizes.__dict__,
        "hit_share": round(sum(v["hit_tokens"] for v in tot.values()) / inp, 4) if inp else None,
        "measured_hit_share": round(sum(v["measured"] for v in tot.values()) / inp, 4) if inp else None,
        "host_hit_share": round(sum(v["host_hits"] for v in tot.values()) / inp, 4) if inp else None,
        "per_engine": per,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("archive", type=Path, help="a run archive (run-<policy>.tar.xz) or a run folder")
    p.add_argument("--max-cached-tokens", type=int, default=49152)
    p.add_argument("--host-tokens", default="65536", help="comma list of host tier sizes, in tokens")
    p.add_argument(
        "--slot-tokens",
        type=int,
        default=12271,
        help="a decode slot's width (the H200's with h200-agentic.toml: 0.15 of 139.8 GiB over 16 slots at "
        "112 KiB a token)",
    )
    p.add_argument("--long-context-tokens", type=int, default=33280)
    p.add_argument("--long-context-slots", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=-1, help="-1: each call's own output length")
    p.add_argument("--out", type=Path, default=None, help="results JSON")
    a = p.parse_args(argv)
    records = load_records(a.archive)
    rows = []
    for host in (int(x) for x in a.host_tokens.split(",")):
        sizes = Sizes(a.max_cached_tokens, host, a.slot_tokens, a.long_context_tokens, a.long_context_slots,
                      a.max_new_tokens)  # fmt: skip
        res = replay(records, sizes)
        rows.append(res)
        print(f"{sizes.label()}: hit share {res['hit_share']} (host tier {res['host_hit_share']}); "
              f"measured in the run {res['measured_hit_share']}", flush=True)  # fmt: skip
    out = {"archive": str(a.archive), "calls": len(records), "replays": rows}
    if a.out is not None:
        a.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
