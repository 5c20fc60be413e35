"""The prefix cache's ideal against what the engines found, from a run's records: how much of the run's
input an engine could have taken from its prefix cache, and where the rest of the shortfall went.

Each record's full input (a delta-encoded input resolved against its parent) is matched, token by token,
against what the calls that had ended before it started left in an engine's cache under the same weight
version: a finished call's input and output but the last output token (sampled, never fed to the model, so
no KV of it exists). A prefix computed by other weights is no cache for this call: an engine drops its
cache at a new version. `ideal`: the longest such match on any engine (every cached prefix kept, every
call sent to the engine holding its prefix); `own`: the longest on the engine that served the call (that
engine kept everything); `any_version`: the longest match under any version. An engine computes at least
the last input token, so a call's ideal is at most its input less one. The measured hits are the
records' `cached_tokens` (gyre-proxy's `metadata`), as in `efficiency.calls_and_cache`.

The input tokens split into:
- `inherent`: no ended call holds them (an execution's first call past its group's shared prompt, each
  tool output, a compaction's new conversation, a sub-agent's task): no cache can hit them;
- `new_version`: only calls of an earlier weight version held them (the execution's context computed
  again under the new weights);
- `elsewhere`: another engine held them (the call was routed, or moved, away from its prefix);
- `lost_on_engine`: the serving engine had them once and did not find them (evicted, or its cache
  key missed a real extension);
- the measured hits.
`calls_unresolved`: calls whose delta's parent is not among the records (left out of every figure).
`by_kind` gives calls that extend their agent's previous call (gyre-proxy's `extends`) apart from the
calls that start a conversation (first calls, sub-agents' first calls, the call after a compaction).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import Any

import numpy as np
from gyre_traj.records import Call


class Radix:
    """Token sequences in a radix tree, to ask how long a prefix of a sequence some inserted sequence
    starts with. Each edge holds a run of tokens (a numpy array), so a walk takes one dict lookup per
    branch point and compares each run with numpy: a run's calls, each extending its execution's previous
    call by a few thousand tokens, cost a few lookups each, not one per token (with a node per token the
    ideal of an H200 run's 1,274 calls and 7.9M input tokens took 5.9 s on a 2-core CPU, 0.10 s so)."""

    __slots__ = ("children",)

    def __init__(self) -> None:
        self.children: dict[int, list[Any]] = {}  # first token -> [run of tokens, child node]

    def insert(self, tokens: np.ndarray) -> None:
        node, n, total = self, 0, int(tokens.size)
        while n < total:
            edge = node.children.get(int(tokens[n]))
            if edge is None:
                node.children[int(tokens[n])] = [tokens[n:].copy(), Radix()]
                return
            run, child = edge
            k = _common(run, tokens[n:])
            if k == run.size:
                n, node = n + k, child
                continue
            if n + k == total:  # a prefix of a path already held
                return
            mid = Radix()  # the sequences part inside this edge: split it where they do
            mid.children[int(run[k])] = [run[k:], child]
            mid.children[int(tokens[n + k])] = [tokens[n + k :].copy(), Radix()]
            edge[0], edge[1] = run[:k], mid
            return

    def match(self, tokens: np.ndarray) -> int:
        """The length of the longest prefix of `tokens` that is a prefix of an inserted sequence."""
        node, n, total = self, 0, int(tokens.size)
        while n < total:
            edge = node.children.get(int(tokens[n]))
            if edge is None:
                break
            run, child = edge
            k = _common(run, tokens[n:])
            n += k
            if k < run.size:
                break
            node = child
        return n


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """The length of the common prefix of `a` and `b`."""
    m = min(a.size, b.size)
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


def full_inputs(records: Iterable[Call]) -> dict[str, np.ndarray]:
    """Each call's whole input, by call id; a call whose delta's parent is not among the records (nor
    that parent's, and so on) is left out."""
    recs = list(records)
    by_id = {r.call_id: r for r in recs}
    out: dict[str, np.ndarray] = {}
    missing: set[str] = set()
    for r in recs:
        chain = [r]
        while True:
            d = chain[-1].input_delta
            if d is None or d.parent in out or d.parent in missing:
                break
            parent = by_id.get(d.parent)
            if parent is None:
                break
            chain.append(parent)
        for c in reversed(chain):
            if c.call_id in out or c.call_id in missing:
                continue
            if c.input_ids is not None:
                out[c.call_id] = np.asarray(c.input_ids)
                continue
            d = c.input_delta
            assert d is not None
            base = out.get(d.parent)
            if base is None:
                missing.add(c.call_id)
                continue
            whole = np.concatenate([base, np.asarray(by_id[d.parent].output_ids)])
            out[c.call_id] = np.concatenate([whole[: d.keep], np.asarray(d.append)])
    return out


def serving_engine(r: Call) -> str:
    """The engine that served the call (the first, where a moved call had several; gyre-proxy's
    `engines` metadata), "" where the record does not say."""
    return r.metadata.get("engines", "").split(",")[0]


def prefix_hits(records: Iterable[Call]) -> dict[str, Any]:
    """The run's measured hits beside the ideal (see the module docstring); None shares when the run
    made no calls."""
    every = list(records)
    inputs = full_inputs(every)
    recs = sorted((r for r in every if r.call_id in inputs), key=lambda r: (r.t_start, r.call_id))
    tries: dict[tuple[str, int], Radix] = {}  # by (engine, weight version)
    ended: list[tuple[float, int, Call]] = []  # (t_end, order, call): to insert once ended
    tot = dict.fromkeys(
        ("input", "cached", "ideal", "any", "own", "inherent", "version", "elsewhere", "lost"), 0
    )
    kinds: dict[str, dict[str, int]] = {}
    for i, r in enumerate(recs):
        while ended and ended[0][0] <= r.t_start:
            _, _, e = heapq.heappop(ended)
            tries.setdefault((serving_engine(e), e.weight_version), Radix()).insert(
                np.concatenate([inputs[e.call_id], np.asarray(e.output_ids)[:-1]])
            )
        x = inputs[r.call_id]
        n = int(x.size)
        most = max(0, n - 1)
        per = {key: min(most, t.match(x)) for key, t in tries.items()}
        any_version = max(per.values(), default=0)
        ideal = max((v for (_, w), v in per.items() if w == r.weight_version), default=0)
        own = per.get((serving_engine(r), r.weight_version), 0)
        cached = min(n, int(r.metadata.get("cached_tokens", 0)))
        tot["input"] += n
        tot["cached"] += cached
        tot["ideal"] += ideal
        tot["any"] += any_version
        tot["own"] += own
        tot["inherent"] += n - max(any_version, cached)
        tot["version"] += max(0, any_version - max(ideal, cached))
        tot["elsewhere"] += max(0, ideal - max(own, cached))
        tot["lost"] += max(0, min(own, ideal) - cached)
        k = kinds.setdefault(
            "extends" if r.metadata.get("extends") else "starts",
            {"calls": 0, "input_tokens": 0, "cached_tokens": 0, "ideal_tokens": 0},
        )
        k["calls"] += 1
        k["input_tokens"] += n
        k["cached_tokens"] += cached
        k["ideal_tokens"] += ideal
        heapq.heappush(ended, (r.t_end, i, r))
    inp = tot["input"]

    def share(v: int) -> float | None:
        return round(v / inp, 4) if inp else None

    return {
        "prefix_cache_hit_share": share(tot["cached"]),
        "prefix_cache_hit_share_ideal": share(tot["ideal"]),
        "prefix_cache_hit_share_own_engine": share(tot["own"]),
        "prefix_cache_hit_share_any_version": share(tot["any"]),
        "input_tokens": inp,
        "missed_tokens": {
            "inherent": tot["inherent"],
            "new_version": tot["version"],
            "elsewhere": tot["elsewhere"],
            "lost_on_engine": tot["lost"],
        },
        "by_kind": kinds,
        "calls_unresolved": len(every) - len(recs),
    }
