"""The prefix cache against a plain reference model: every stored sequence kept separately (no
dominance, no eviction); a lookup never claims more than the reference could serve, and serves the
KV of exactly the tokens it claims."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

torch = pytest.importorskip("torch")
import numpy as np  # noqa: E402
from gyre_engine.server.batch import RowKV  # noqa: E402
from gyre_engine.server.prefix_cache import PrefixCache, common_prefix_len  # noqa: E402

BUDGET = 40
# few token values, so sequences share prefixes often
tokens = st.lists(st.integers(0, 3), min_size=1, max_size=12)


def kv_of(ids: list[int]) -> RowKV:
    """KV whose entries encode the token ids (and their positions), so content can be checked."""
    t = torch.tensor([[float(x * 100 + i) for i, x in enumerate(ids)]]).reshape(1, 1, len(ids), 1)
    return RowKV([t.clone()], [-t.clone()])


class PrefixCacheMachine(RuleBasedStateMachine):
    """Found the eviction bug: `list.remove` compared entries (numpy arrays) by value."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = PrefixCache(BUDGET)
        self.stored: list[list[int]] = []

    @rule(ids=tokens)
    def insert(self, ids: list[int]) -> None:
        self.cache.insert(ids, kv_of(ids))
        self.stored.append(ids)

    @precondition(lambda self: bool(self.stored))
    @rule(data=st.data(), extra=st.lists(st.integers(0, 3), max_size=4))
    def lookup_an_extension(self, data: st.DataObject, extra: list[int]) -> None:
        base = data.draw(st.sampled_from(self.stored))
        self._check(base + extra)

    @rule(query=tokens)
    def lookup(self, query: list[int]) -> None:
        self._check(query)

    def _check(self, query: list[int]) -> None:
        limit = max(len(query) - 1, 0)
        hit = self.cache.lookup(query, limit)
        q = np.asarray(query)
        best = max([min(common_prefix_len(np.asarray(s), q), limit) for s in self.stored] + [0])
        assert hit.length <= best
        if hit.whole:  # the hit is an entry's whole context: a sequence stored as it is
            assert query[: hit.length] in self.stored
        if hit.kv is not None:
            assert hit.length > 0 and hit.kv.length == hit.length
            assert torch.equal(hit.kv.keys[0], kv_of(query[: hit.length]).keys[0])
            assert torch.equal(hit.kv.values[0], kv_of(query[: hit.length]).values[0])

    @invariant()
    def within_budget(self) -> None:
        assert self.cache.total_tokens <= BUDGET

    @invariant()
    def the_running_total_is_the_sum_of_the_entries(self) -> None:
        entries = [e for bucket in self.cache._buckets.values() for e in bucket]
        assert self.cache.total_tokens == sum(len(e.tokens) for e in entries)
        assert len(self.cache) == len(entries) and all(bucket for bucket in self.cache._buckets.values())

    @invariant()
    def the_latest_insert_is_served_whole(self) -> None:
        if self.stored and len(self.stored[-1]) > 1:
            last = self.stored[-1]
            assert self.cache.lookup(last, len(last)).length == len(last)


TestPrefixCache = PrefixCacheMachine.TestCase
TestPrefixCache.settings = __import__("hypothesis").settings(
    max_examples=60, stateful_step_count=25, deadline=None
)


def test_lookups_compare_only_entries_with_the_same_first_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """A thousand unrelated cached contexts cost a lookup nothing: only entries starting with the
    query's first token are compared."""
    import gyre_engine.server.prefix_cache as pc

    cache = PrefixCache(1 << 20)
    for first in range(1000):
        ids = [first, 5, 6, 7]
        cache.insert(ids, kv_of(ids))
    calls = [0]
    real = pc.common_prefix_len

    def counting(a: np.ndarray, b: np.ndarray) -> int:
        calls[0] += 1
        return real(a, b)

    monkeypatch.setattr(pc, "common_prefix_len", counting)
    hit = cache.lookup([417, 5, 6, 9], 3)
    assert hit.length == 3 and calls[0] == 1
    assert cache.lookup([5000, 1], 1).length == 0 and calls[0] == 1


def test_a_hit_says_whether_it_is_its_entrys_whole_context() -> None:
    """An extending call's hit is its entry whole; a call sharing only a group's prompt with an entry is
    not (the engine's long slots give the slot to the first, not to the second)."""
    cache = PrefixCache(100, host_tokens=100)
    context = [7, 1, 2, 3, 4, 5]
    cache.insert(context, kv_of(context))
    ext = cache.lookup([*context, 9, 9], 7)
    assert (ext.length, ext.whole) == (6, True)
    shared = cache.lookup([7, 1, 2, 8, 8], 4)
    assert (shared.length, shared.whole) == (3, False)
    assert not cache.lookup(context, 5).whole  # cut by the limit: the entry is longer
    cache.evict(100)  # to the host tier: the same there
    host = cache.lookup([*context, 9], 6)
    assert (host.on_host, host.whole) == (True, True)
    assert not cache.lookup([7, 1, 8], 2).whole


def test_a_long_slots_cached_context_is_out_of_the_budget_and_of_eviction() -> None:
    """Entries that are a long slot's views (`LongRowKV`) hold no memory of their own: they count in
    `total_tokens`, not in `held_tokens`; the budget and `evict` (memory pressure) drop only the cache's
    own copies, least recently used first, and a long entry past the budget is still kept."""
    from gyre_engine.server.batch import buffer_row

    buf = torch.zeros(2, 1, 2, 1, 64, 1)  # the long slots' buffer: 2 slots of 64 columns
    cache = PrefixCache(30)
    long_a, long_b = [1] * 40, [2] * 20  # the first alone passes the budget of 30
    cache.insert(long_a, buffer_row(buf, len(long_a), 0), owned=True)
    cache.insert(long_b, buffer_row(buf, len(long_b), 1), owned=True)
    assert (cache.total_tokens, cache.held_tokens) == (60, 0)
    for ids in ([3] * 10, [4] * 10, [5] * 10):  # copies: 30 tokens, the whole budget
        cache.insert(ids, kv_of(ids))
    assert (cache.total_tokens, cache.held_tokens) == (90, 30)
    cache.insert([6] * 10, kv_of([6] * 10))  # over the budget: the oldest copy goes, no long entry
    assert cache.held_tokens == 30 and cache.lookup([3] * 10 + [0], 10).length == 0
    assert cache.lookup([*long_a, 0], 40).length == 40 and cache.lookup([*long_b, 0], 20).length == 20
    assert cache.evict(15) == 20  # memory pressure: two copies (the least recently used), not a slot
    assert cache.held_tokens == 10 and cache.lookup([4] * 10 + [0], 10).length == 0
    assert cache.lookup([6] * 10 + [0], 10).length == 10
    assert cache.evict(100) == 10 and cache.held_tokens == 0  # copies only: the slots' contexts stay
    assert cache.total_tokens == 60
    # which slot's context was used least recently (the one a new long context is given)
    in_slot = [lambda kv, s=s: getattr(kv, "row", None) == s for s in (0, 1)]
    assert cache.last_used(in_slot[1]) > cache.last_used(in_slot[0])
    cache.lookup([*long_a, 0], 40)
    assert cache.last_used(in_slot[0]) > cache.last_used(in_slot[1])
    assert cache.last_used(lambda kv: False) == -1


def kv_layers(ids: list[int], layers: int = 4) -> RowKV:
    """`kv_of` with `layers` layers (the host tier places each layer's keys and values apart)."""
    kv = kv_of(ids)
    return RowKV([kv.keys[0] + i for i in range(layers)], [kv.values[0] - i for i in range(layers)])


def test_the_host_tier_keeps_what_leaves_the_device() -> None:
    """With a host budget, what the device budget, `evict` or `release_where` would drop is copied to the
    host instead: a lookup then serves the same KV from there (counted), the host tier drops its least
    recently used entries to make room within its own budget (or the entry spilled, when it is the least
    recently used), and a long slot's context released to it is a copy that
    the slot's next writes do not change."""
    from gyre_engine.server.batch import buffer_row

    cache = PrefixCache(20, host_tokens=25)
    for ids in ([3] * 10, [4] * 10, [5] * 10):  # the third passes the device budget: [3] goes to the host
        cache.insert(ids, kv_layers(ids))
    assert (cache.held_tokens, cache.host_held_tokens, cache.spilled_tokens) == (20, 10, 10)
    hit = cache.lookup([3] * 10 + [0], 10)
    assert hit.length == 10 and hit.on_host and cache.host_hit_tokens == 0  # counted once a call uses it
    cache.used(hit)
    assert cache.host_hit_tokens == 10
    assert torch.equal(hit.kv.keys[0], kv_of([3] * 10).keys[0])
    assert cache.evict(5) == 10  # [4], the device's least recently used, to the host
    assert (cache.held_tokens, cache.host_held_tokens) == (10, 20)
    cache.used(hit4 := cache.lookup([4] * 10 + [0], 10))
    assert hit4.length == 10 and cache.host_hit_tokens == 20
    del hit, hit4  # read no more (an entry a lookup's KV still reads is not dropped for room)
    # [5] too: 30 on the host, past its 25, so the least recently used entry goes: [5] itself (its last
    # use is older than the lookups of [3] and [4]), and it does not count as spilled
    cache.evict(5)
    assert (cache.held_tokens, cache.host_held_tokens, cache.spilled_tokens) == (0, 20, 20)
    assert cache.lookup([5] * 10 + [0], 10).length == 0 and cache.lookup([4] * 10 + [0], 10).length == 10

    buf = torch.arange(2 * 4 * 2 * 1 * 64 * 1, dtype=torch.float32).reshape(2, 4, 2, 1, 64, 1)
    long_ids = [7] * 12
    cache.insert(long_ids, buffer_row(buf, 12, 1), owned=True)
    before = buf[0, 0, 1, 0, :12, 0].clone()
    assert cache.release_where(lambda kv: getattr(kv, "row", None) == 1) == 1
    buf.zero_()  # the slot is written for another context
    hit = cache.lookup([*long_ids, 0], 12)
    assert hit.length == 12 and torch.equal(hit.kv.keys[0][0, 0, :, 0], before)
    assert (
        cache.host_held_tokens == 22 and cache.total_tokens == 22
    )  # [3] dropped to make room: 32 was past 25
    assert cache.lookup([3] * 10 + [0], 10).length == 0


def test_without_a_host_tier_what_leaves_the_device_is_dropped() -> None:
    cache = PrefixCache(20)
    for ids in ([3] * 10, [4] * 10, [5] * 10):
        cache.insert(ids, kv_of(ids))
    assert (cache.held_tokens, cache.host_held_tokens, cache.spilled_tokens) == (20, 0, 0)
    assert cache.lookup([3] * 10 + [0], 10).length == 0
    assert cache.evict(1) == 10 and cache.total_tokens == 10


def test_a_host_entry_being_read_keeps_its_memory() -> None:
    """The host tier is one buffer of its budget's size. A lookup's KV of a host entry holds that entry's
    span: the entry is not dropped for room while the KV lives (the entry spilled after it is dropped
    instead), and once the entry leaves the cache its span is still not reused until the KV is dropped,
    so what the reader holds never changes under it. Then the span goes back to the arena."""
    from gyre_engine.server.host_arena import HostRowKV

    cache = PrefixCache(10, host_tokens=20)
    for ids in ([3] * 10, [4] * 10, [5] * 10):  # [3] then [4] to the host: the tier is full
        cache.insert(ids, kv_of(ids))
    assert cache.host_held_tokens == 20
    hit = cache.lookup([3] * 10 + [0], 10)
    assert isinstance(hit.kv, HostRowKV) and hit.on_host
    want = kv_of([3] * 10).keys[0]
    cache.evict(10)  # [5] to the host: [3] is read, so [4] (idle, used before [5]) makes room
    assert cache.lookup([4] * 10 + [0], 10).length == 0
    assert cache.lookup([5] * 10 + [0], 10).length == 10
    assert torch.equal(hit.kv.keys[0], want)

    cache.insert([6] * 10, kv_of([6] * 10))
    cache.clear()  # every entry leaves; [3]'s span is still read
    cache.insert([7] * 10, kv_of([7] * 10))
    cache.insert([8] * 10, kv_of([8] * 10))  # [7] to the host: the free half, not [3]'s span
    assert cache.host_held_tokens == 10 and torch.equal(hit.kv.keys[0], want)
    cropped = hit.kv.crop(4)  # a crop holds the span too
    del hit
    cache.insert([9] * 10, kv_of([9] * 10))  # [8] to the host: [7] goes, as the crop reads [3]'s span
    assert cache.host_held_tokens == 10 and torch.equal(cropped.keys[0], want[:, :, :4])
    assert cache.lookup([7] * 10 + [0], 10).length == 0
    assert cache.lookup([8] * 10 + [0], 10).on_host
    del cropped  # now the span is free
    cache.insert([10] * 10, kv_of([10] * 10))  # [9] to the host, in [3]'s span: nothing dropped
    assert cache.host_held_tokens == 20 and cache.lookup([9] * 10 + [0], 10).on_host
    assert cache.lookup([8] * 10 + [0], 10).on_host


def test_a_long_slot_goes_to_the_context_it_extends_and_not_to_one_it_shares_a_prompt_with() -> None:
    """`take_long_slot`: a call that extends a slot's whole context takes that slot in place (its entry
    dropped); one that shares only a prompt with it takes an idle slot no entry holds; with every idle slot
    held, the one used least recently, whose context goes to the host tier first."""
    from gyre_engine.server.batch import buffer_row

    buf = torch.zeros(2, 1, 3, 1, 64, 1)  # the long slots' buffer: 3 slots of 64 columns
    cache = PrefixCache(100, host_tokens=100)
    a, b = [1] * 10 + [2] * 20, [1] * 10 + [3] * 20  # two contexts sharing a prompt of 10
    cache.insert(a, buffer_row(buf, len(a), 0), owned=True)
    shared = cache.lookup([*b, 0], len(b))
    assert shared.length == 10 and not shared.whole
    assert cache.take_long_slot(buf, [0, 1, 2], shared) == (1, False)  # not "a"'s slot
    assert cache.lookup([*a, 0], len(a)).length == len(a)  # "a" kept in place
    cache.insert(b, buffer_row(buf, len(b), 1), owned=True)
    ext = cache.lookup([*a, 5], len(a))
    assert ext.whole and cache.take_long_slot(buf, [0, 2], ext) == (0, True)
    assert cache.lookup([*a, 0], len(a)).length == 10  # its entry dropped: the slot is the call's now
    # every idle slot held: the least recently used one, its context to the host tier
    cache.insert(a, buffer_row(buf, len(a), 0), owned=True)
    cache.lookup([*b, 0], len(b))  # "b" used last
    other = cache.lookup([9, 9], 1)
    assert cache.take_long_slot(buf, [0, 1], other) == (0, False)
    back = cache.lookup([*a, 0], len(a))
    assert back.length == len(a) and back.on_host
