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
budget, `evict` or `release_where` would drop is copied to the host instead, into a span of one host
buffer of the tier's size (`HostArena`, page-locked on a GPU), and a lookup serves it from there
(`PrefixHit.kv` is then a `HostRowKV`: host tensors, which the caller copies where it needs them, a
transfer in place of a prefill). Room for a spilled entry is made by dropping host entries least
recently used first, but not one that a lookup's `HostRowKV` still reads, and not one used more recently
than the entry being spilled (that entry is dropped instead).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from gyre_xfer.pinning import Pinning

from gyre_engine.server.batch import LongRowKV, RowKV
from gyre_engine.server.host_arena import HostArena, HostRowKV


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


@dataclass(frozen=True)
class PrefixHit:
    """`length` tokens of the query are covered by `kv` (already cropped to them)."""

    length: int
    kv: RowKV | None
    on_host: bool = False
    """`kv` is the host tier's (host tensors)."""
    whole: bool = False
    """The hit is its entry's whole context (the query extends it), not a part it shares with another
    context (such as a group's prompt)."""


class PrefixCache:
    """Least-recently-used store of (token ids, KV) with a budget of `max_tokens` cached tokens.

    Entries are bucketed by their first token: only entries that start like the query can share a prefix
    with it, so a lookup or insert compares against those alone (a thousand unrelated contexts cost one
    dict lookup, not a thousand comparisons)."""

    def __init__(self, max_tokens: int, host_tokens: int = 0, pinning: Pinning | None = None) -> None:
        self.max_tokens = max_tokens
        self.host_tokens = host_tokens
        """Budget of the host tier, in tokens (0: none; what leaves the device is dropped)."""
        self._pinning = pinning
        self._arena: HostArena | None = None
        """The host tier's memory: `host_tokens` tokens' worth, allocated by `reserve_host` or at the
        first spill (when the size of a token's KV is known)."""
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

    def reserve_host(self, token_bytes: int) -> None:
        """Allocate the host tier now (`host_tokens` tokens of `token_bytes` bytes of KV each), rather than
        at the first spill; nothing without a host budget."""
        if self.host_tokens > 0 and self._arena is None:
            self._arena = HostArena(self.host_tokens * token_bytes, self._pinning)
        if self._arena is not None:
            self._arena.reserve()

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory the host tier holds (allocated once, whatever it stores)."""
        return self._arena.nbytes if self._arena is not None and self._arena.allocated else 0

    @property
    def host_pinned(self) -> bool:
        """Whether the host tier's memory is page-locked."""
        return self._arena is not None and self._arena.pinned

    def clear(self) -> None:
        for e in self._entries():
            if e.on_host:
                self._host_arena().release(cast(HostRowKV, e.kv))
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
        whole = best_len == len(best.tokens)
        if best.on_host:
            kv = self._host_arena().lease(cast(HostRowKV, best.kv), best_len)
            return PrefixHit(best_len, kv, True, whole)
        return PrefixHit(best_len, best.kv.crop(best_len), whole=whole)

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
        gone = [e for e in self._entries() if not e.on_host and match(e.kv)]
        for e in gone:
            self._spill(e)
        return len(gone)

    def _spill(self, e: _Entry) -> None:
        """`e` out of device memory: into the host tier, or dropped (no host tier, or no room there)."""
        if e.on_host:
            return
        n = len(e.tokens)
        self._remove(e)
        if n > self.host_tokens:
            return
        kv = self._to_host(e)
        if kv is None:
            return
        e.kv, e.on_host = kv, True
        self._add(e)
        self.spilled_tokens += n

    def _to_host(self, e: _Entry) -> HostRowKV | None:
        """A copy of `e`'s KV in the host tier, made room for by dropping host entries least recently used
        first (none that a lookup's KV still reads); None, `e` dropped, when `e` is used less recently
        than every host entry that could go, or nothing left could make room."""
        self.reserve_host(e.kv.nbytes() // len(e.tokens))  # (done at start-up by an engine)
        arena = self._host_arena()
        while (kv := arena.place(e.kv)) is None:
            idle = [x for x in self._entries() if x.on_host and not arena.read(cast(HostRowKV, x.kv))]
            if not idle:
                return None
            victim = min(idle, key=lambda x: x.last_used)
            if victim.last_used > e.last_used:
                return None
            self._remove(victim)
            del victim, idle
        return kv

    def _host_arena(self) -> HostArena:
        assert self._arena is not None, "host entries without a host arena"
        return self._arena

    def _entries(self) -> list[_Entry]:
        """Every entry, device and host (a list: callers may remove entries while they go through it)."""
        return [e for b in self._buckets.values() for e in b]

    def last_used(self, match: Callable[[RowKV], bool]) -> int:
        """When an entry whose KV `match` accepts was last inserted or looked up (a clock: larger is
        later), the latest of them; -1 if none."""
        return max((e.last_used for e in self._entries() if match(e.kv)), default=-1)

    def _least_recent_held(self) -> _Entry:
        return min(
            (e for e in self._entries() if self._holds_device(e)),
            key=lambda e: e.last_used,
        )

    @staticmethod
    def _holds_device(e: _Entry) -> bool:
        """Whether `e`'s KV is device memory of the cache's own (not a long slot's views, not on the host)."""
        return not e.on_host and not isinstance(e.kv, LongRowKV)

    def take_long_slot(self, buf: torch.Tensor, idle: Sequence[int], hit: PrefixHit) -> tuple[int, bool]:
        """The long slot of `buf` (one of `idle`, not empty) that a call whose lookup found `hit` takes, and
        whether its hit is in place there (nothing to copy): the slot the hit is when the call extends
        that slot's whole context (its entry dropped: the finished call leaves a longer one); else the
        lowest idle slot no entry holds, else the idle one whose cached context was used least recently,
        whose entries go to the host tier (or are dropped) before the slot is written. A hit that only
        shares part of a slot's context (a group's prompt) does not take that slot from its context,
        unless no other slot is idle."""

        def in_slot(slot: int) -> Callable[[RowKV], bool]:
            return lambda kv: isinstance(kv, LongRowKV) and kv.buf is buf and kv.row == slot

        kv = hit.kv
        held = kv.row if isinstance(kv, LongRowKV) and kv.buf is buf and kv.row in idle else None
        if held is not None and hit.whole:
            self.drop_where(in_slot(held))
            return held, True
        unheld = [s for s in idle if not self.holds(in_slot(s))]
        slot = unheld[0] if unheld else min(idle, key=lambda s: self.last_used(in_slot(s)))
        self.release_where(in_slot(slot))
        return slot, slot == held

    def holds(self, match: Callable[[RowKV], bool]) -> bool:
        """Whether some entry's KV is one `match` accepts."""
        return any(match(e.kv) for e in self._entries())

    def drop_where(self, match: Callable[[RowKV], bool]) -> int:
        """Drop every entry whose KV `match` accepts (a long slot taking its buffer back); returns how many."""
        gone = [e for e in self._entries() if match(e.kv)]
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
            self._host_arena().release(cast(HostRowKV, e.kv))
        elif not isinstance(e.kv, LongRowKV):
            self._held -= len(e.tokens)
