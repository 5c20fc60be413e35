"""Prefix cache: KV of finished sequences, looked up by the longest common prefix of token ids.

An agent resends its whole, growing context every call, so the entry left by call k is a prefix of call
k+1; an entry that a newer one extends is dropped. Entries are evicted least-recently-used past a token
budget. Lookups return a view cropped to the shared prefix; the caller never mutates it (a long slot's
buffer, `LongRowKV`, is the exception: the slot drops its entries, `drop_where`, before writing to it).

An entry that is a long slot's views holds no memory of its own (the long slots' buffer is allocated
whatever they hold): it counts in `total_tokens` but not in the budget (`held_tokens`), and neither the
budget nor `evict` (memory pressure) drops it, since that would free nothing and lose the context; it
goes when its slot is taken for another context (`release_where`).

With a host budget (`host_tokens` > 0) the cache has a second tier in host memory: what the device
budget, `evict` or `release_where` would drop is copied to the host instead (least recently used
host entries dropped past that budget), and a lookup serves it from there (`PrefixHit.kv` then holds
host tensors: the caller copies them where it needs them, a transfer in place of a prefill).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gyre_engine.server.batch import LongRowKV, RowKV


def _owned(kv: RowKV) -> RowKV:
    """`kv` itself when its tensors own exactly their storage (nothing else can change or pin it: caches
    replace tensors, never write into them), else a compact copy (e.g. a row view of a batch)."""

    def own(t: torch.Tensor) -> bool:
        return t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()

    if isinstance(kv, LongRowKV) or all(own(t) for t in (*kv.keys, *kv.values)):
        return kv  # a long slot's buffer is handed over, never copied
    return kv.clone()


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


@dataclass(eq=False)  # identity: entries hold arrays, which do not compare to a bool
class _Entry:
    tokens: np.ndarray
    kv: RowKV
    last_used: int
    on_host: bool = False


def _to_host(kv: RowKV) -> RowKV:
    """A compact copy of `kv` in host memory."""
    return RowKV(
        [k.to("cpu", copy=True).contiguous() for k in kv.keys],
        [v.to("cpu", copy=True).contiguous() for v in kv.values],
    )


@dataclass(frozen=True)
class PrefixHit:
    """`length` tokens of the query are covered by `kv` (already cropped to them)."""

    length: int
    kv: RowKV | None
    on_host: bool = False
    """`kv` is the host tier's (host tensors)."""


class PrefixCache:
    """Least-recently-used store of (token ids, KV) with a budget of `max_tokens` cached tokens.

    Entries are bucketed by their first token: only entries that start like the query can share a prefix
    with it, so a lookup or insert compares against those alone (a thousand unrelated contexts cost one
    dict lookup, not a thousand comparisons)."""

    def __init__(self, max_tokens: int, host_tokens: int = 0) -> None:
        self.max_tokens = max_tokens
        self.host_tokens = host_tokens
        """Budget of the host tier, in tokens (0: none; what leaves the device is dropped)."""
        self._buckets: dict[int, list[_Entry]] = {}
        self._total = 0
        self._held = 0
        self._host = 0
        self._clock = 0
        self.version = 0
        """Bumped whenever an entry comes or goes: a lookup made at the same version finds the same."""
        self.spilled_tokens = 0
        """Tokens copied to the host tier since start."""
        self.host_hit_tokens = 0
        """Tokens of the host tier's hits that calls started on since start (`used`)."""

    @property
    def total_tokens(self) -> int:
        """Tokens of every entry."""
        return self._total

    @property
    def held_tokens(self) -> int:
        """Tokens of the entries whose KV is the cache's own device memory (not a long slot's views, not
        the host tier's): what the budget counts and what `evict` can free."""
        return self._held

    @property
    def host_held_tokens(self) -> int:
        """Tokens of the entries in the host tier."""
        return self._host

    def __len__(self) -> int:
        return sum(len(b) for b in self._buckets.values())

    def clear(self) -> None:
        self.version += 1
        self._buckets.clear()
        self._total = 0
        self._held = 0
        self._host = 0

    def lookup(self, tokens: Sequence[int] | np.ndarray, limit: int) -> PrefixHit:
        """Longest cached prefix of `tokens` (ids, or an int64 array of them: not copied), at most `limit`
        long."""
        if len(tokens) == 0:
            return PrefixHit(0, None)
        query = np.asarray(tokens, dtype=np.int64)
        best, best_len = None, 0
        for e in self._buckets.get(int(query[0]), ()):
            n = min(common_prefix_len(e.tokens, query), limit)
            if n > best_len:
                best, best_len = e, n
        if best is None:
            return PrefixHit(0, None)
        self._clock += 1
        best.last_used = self._clock
        return PrefixHit(best_len, best.kv.crop(best_len), best.on_host)

    def used(self, hit: PrefixHit) -> None:
        """Count `hit` as served: a call starts on it (a request that waits is looked up again at every
        step, and only the lookup it starts on counts)."""
        if hit.on_host:
            self.host_hit_tokens += hit.length

    def insert(self, tokens: list[int], kv: RowKV, owned: bool = False) -> None:
        """Store KV covering `tokens` (cloned, unless `owned`: a copy nothing else holds or writes, such
        as `SlotBatch.row_kv_copy`'s); entries that are a prefix of `tokens` are replaced."""
        if len(tokens) != kv.length:
            raise ValueError(f"KV covers {kv.length} tokens but {len(tokens)} token ids were given")
        if not tokens or (len(tokens) > self.max_tokens and not isinstance(kv, LongRowKV)):
            return
        arr = np.asarray(tokens, dtype=np.int64)
        bucket = self._buckets.setdefault(int(arr[0]), [])
        for e in bucket:
            if len(e.tokens) >= len(arr) and common_prefix_len(e.tokens, arr) == len(arr):
                self._clock += 1
                e.last_used = self._clock
                return  # already covered by a longer entry
        for e in [e for e in bucket if common_prefix_len(e.tokens, arr) == len(e.tokens)]:
            self._remove(e)  # prefixes of the new entry
        self._clock += 1
        self._add(_Entry(arr, kv if owned else _owned(kv), self._clock))
        while self._held > self.max_tokens:
            self._spill(self._least_recent_held())

    def evict(self, tokens: int) -> int:
        """Free the device memory of least-recently-used entries that hold their own until at least
        `tokens` cached tokens are gone from the device (or none is left): each is moved to the host
        tier, or dropped without one; returns the tokens gone from the device."""
        gone = 0
        while gone < tokens and self._held:
            victim = self._least_recent_held()
            gone += len(victim.tokens)
            self._spill(victim)
        return gone

    def release_where(self, match: Callable[[RowKV], bool]) -> int:
        """Entries whose KV `match` accepts (a long slot taken for another context) leave their KV's
        place: copied to the host tier, or dropped without one; returns how many."""
        gone = [e for b in self._buckets.values() for e in b if not e.on_host and match(e.kv)]
        for e in gone:
            self._spill(e)
        return len(gone)

    def _spill(self, e: _Entry) -> None:
        """`e` out of device memory: into the host tier (the least recently used host entries dropped
        past its budget), or dropped."""
        if e.on_host:
            return
        n = len(e.tokens)
        self._remove(e)
        if n > self.host_tokens:
            return
        e.kv, e.on_host = _to_host(e.kv), True
        self._add(e)
        while self._host > self.host_tokens:
            self._remove(
                min((x for b in self._buckets.values() for x in b if x.on_host), key=lambda x: x.last_used)
            )
        if any(x is e for x in self._buckets.get(int(e.tokens[0]), ())):  # unless the least recent itself
            self.spilled_tokens += n

    def last_used(self, match: Callable[[RowKV], bool]) -> int:
        """When an entry whose KV `match` accepts was last inserted or looked up (a clock: larger is
        later), the latest of them; -1 if none."""
        return max((e.last_used for b in self._buckets.values() for e in b if match(e.kv)), default=-1)

    def _least_recent_held(self) -> _Entry:
        return min(
            (e for b in self._buckets.values() for e in b if self._holds_device(e)),
            key=lambda e: e.last_used,
        )

    @staticmethod
    def _holds_device(e: _Entry) -> bool:
        """Whether `e`'s KV is device memory of the cache's own (not a long slot's views, not on the host)."""
        return not e.on_host and not isinstance(e.kv, LongRowKV)

    def holds(self, match: Callable[[RowKV], bool]) -> bool:
        """Whether some entry's KV is one `match` accepts."""
        return any(match(e.kv) for b in self._buckets.values() for e in b)

    def drop_where(self, match: Callable[[RowKV], bool]) -> int:
        """Drop every entry whose KV `match` accepts (a long slot taking its buffer back); returns how many."""
        gone = [e for b in self._buckets.values() for e in b if match(e.kv)]
        for e in gone:
            self._remove(e)
        return len(gone)

    def _add(self, e: _Entry) -> None:
        self.version += 1
        self._buckets.setdefault(int(e.tokens[0]), []).append(e)
        self._total += len(e.tokens)
        if e.on_host:
            self._host += len(e.tokens)
        elif not isinstance(e.kv, LongRowKV):
            self._held += len(e.tokens)

    def _remove(self, e: _Entry) -> None:
        self.version += 1
        first = int(e.tokens[0])
        bucket = self._buckets[first]
        bucket[:] = [x for x in bucket if x is not e]
        if not bucket:
            del self._buckets[first]
        self._total -= len(e.tokens)
        if e.on_host:
            self._host -= len(e.tokens)
        elif not isinstance(e.kv, LongRowKV):
            self._held -= len(e.tokens)
