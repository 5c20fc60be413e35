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
        if hit.kv is not None:
            assert hit.length > 0 and hit.kv.length == hit.length
            assert torch.equal(hit.kv.keys[0], kv_of(query[: hit.length]).keys[0])
            assert torch.equal(hit.kv.values[0], kv_of(query[: hit.length]).values[0])

    @invariant()
    def within_budget(self) -> None:
        assert self.cache.total_tokens <= BUDGET

    @invariant()
    def the_latest_insert_is_served_whole(self) -> None:
        if self.stored and len(self.stored[-1]) > 1:
            last = self.stored[-1]
            assert self.cache.lookup(last, len(last)).length == len(last)


TestPrefixCache = PrefixCacheMachine.TestCase
TestPrefixCache.settings = __import__("hypothesis").settings(
    max_examples=60, stateful_step_count=25, deadline=None
)
