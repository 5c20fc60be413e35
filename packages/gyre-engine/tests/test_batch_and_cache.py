"""The left-padded decode batch gives every row the logits it would have alone, as rows join and
leave; the prefix cache finds longest prefixes, replaces dominated entries and respects its budget."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
from gyre_engine.server.batch import DecodeBatch, RowKV, cache_from_layers, cache_kwarg, cache_layers  # noqa: E402
from gyre_engine.server.lanes import Lanes  # noqa: E402
from gyre_engine.server.prefill import prefill_chunk, prefill_group, prefill_packed, start_cache  # noqa: E402
from gyre_engine.server.prefix_cache import PrefixCache  # noqa: E402


def prefill(model: Any, ids: list[int]) -> tuple[RowKV, torch.Tensor]:
    cache = cache_from_layers([], [])
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), use_cache=True, **{cache_kwarg(model): cache})
    return RowKV(*cache_layers(cache)), out.logits[0, -1]


def solo_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1]


@settings(max_examples=6, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=4),
    drop=st.lists(st.integers(0, 3), max_size=2),
)
def test_rows_get_their_solo_logits_while_joining_and_leaving(
    hf_model: Any, lengths: list[int], drop: list[int]
) -> None:
    batch = DecodeBatch(torch.device("cpu"))
    seqs: list[list[int]] = []
    together = []
    for i, n in enumerate(lengths):
        ids = [1000 + 17 * i + j for j in range(n)]
        kv, logits = prefill(hf_model, ids)
        nxt = int(logits.argmax())
        if i < 2:  # the first rows join together, the rest one by one
            together.append((kv, nxt))
            if i == min(1, len(lengths) - 1):
                batch.add_many(together)
        else:
            batch.add(kv, nxt)
        seqs.append([*ids, nxt])
    for step in range(3):
        logits = batch.step(hf_model)
        for r, seq in enumerate(seqs):
            assert torch.allclose(logits[r], solo_logits(hf_model, seq), atol=1e-4)
            nxt = int(logits[r].argmax())
            batch.next_tokens[r] = nxt
            seq.append(nxt)
        if step == 0:
            gone = sorted({d for d in drop if d < len(seqs) - 1})
            batch.remove(gone)
            seqs = [s for i, s in enumerate(seqs) if i not in gone]
    for r, seq in enumerate(seqs):
        kv = batch.row_kv(r)
        assert kv.length == len(seq) - 1


def test_a_padded_group_prefill_gives_each_prompt_its_solo_logits_and_kv(hf_model: Any) -> None:
    ctxs = [[1000 + i for i in range(n)] for n in (3, 11, 1, 7)]
    rows, logits = prefill_group(hf_model, cache_kwarg(hf_model), ctxs, torch.device("cpu"))
    for c, row, lg in zip(ctxs, rows, logits, strict=True):
        solo_kv, solo = prefill(hf_model, c)
        assert row.length == len(c)
        assert torch.allclose(lg, solo, atol=1e-4)
        for a, b in zip(row.keys + row.values, solo_kv.keys + solo_kv.values, strict=True):
            assert torch.allclose(a, b, atol=1e-4)
    cached, _ = prefill(hf_model, ctxs[1][:5])  # then the rest in chunks of 2 and 4 on top of it
    cache = start_cache(cached)
    kw, cpu = cache_kwarg(hf_model), torch.device("cpu")
    with torch.no_grad():
        prefill_chunk(hf_model, kw, ctxs[1], cache, 5, 7, cpu)
        lg = prefill_chunk(hf_model, kw, ctxs[1], cache, 7, 11, cpu)
    assert RowKV(*cache_layers(cache)).length == 11 and torch.allclose(lg[0], logits[1], atol=1e-4)
    assert cached.length == 5  # the cached prefix itself was not written to


@settings(max_examples=8, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(1, 9), st.integers(1, 6)), min_size=1, max_size=4))
def test_a_packed_prefill_gives_each_row_its_solo_logits_and_kv(
    hf_model: Any, rows: list[tuple[int, int]]
) -> None:
    """Rows of cached prefixes (`cached` tokens) extended by `rest` new tokens each, in one packed pass:
    each row's last logits and whole KV are those of its context alone, and its cached prefix is not
    written to."""
    ctxs = [[700 + 29 * i + 3 * j for j in range(cached + rest)] for i, (cached, rest) in enumerate(rows)]
    prefixes = [prefill(hf_model, c[:cached])[0] for c, (cached, _) in zip(ctxs, rows, strict=True)]
    caches = [start_cache(kv) for kv in prefixes]
    with torch.no_grad():
        logits = prefill_packed(
            hf_model,
            cache_kwarg(hf_model),
            [(c, cached, cache) for c, (cached, _), cache in zip(ctxs, rows, caches, strict=True)],
            torch.device("cpu"),
        )
    assert logits.shape[0] == len(rows)
    for c, cache, lg, kv, (cached, _) in zip(ctxs, caches, logits, prefixes, rows, strict=True):
        solo_kv, solo = prefill(hf_model, c)
        assert torch.allclose(lg, solo, atol=1e-4)
        row = RowKV(*cache_layers(cache))
        assert row.length == len(c) and kv.length == cached
        for a, b in zip(row.keys + row.values, solo_kv.keys + solo_kv.values, strict=True):
            assert torch.allclose(a, b, atol=1e-4)


def test_a_packed_row_needs_a_cached_prefix(hf_model: Any) -> None:
    with pytest.raises(ValueError, match="cached prefix"):
        prefill_packed(
            hf_model, cache_kwarg(hf_model), [([1, 2, 3], 0, start_cache(None))], torch.device("cpu")
        )


@pytest.mark.long
@pytest.mark.slow
def test_the_compiled_group_prefill_equals_the_eager_one(hf_model: Any) -> None:
    """What the engine runs on CUDA (`compile_prefill`): `group_forward` through torch.compile, with
    dynamic shapes (groups of other sizes and widths reuse the compilation), gives each prompt the
    eager pass's logits and KV."""
    from gyre_engine.server.prefill import group_forward
    from gyre_engine.server.slots import compile_fn

    fn = compile_fn(group_forward)
    kw, cpu = cache_kwarg(hf_model), torch.device("cpu")
    for sizes in ((3, 11, 1, 7), (5, 9), (12, 12, 30)):
        ctxs = [[500 + 3 * i + n for i in range(n)] for n in sizes]
        with torch.inference_mode():
            want_rows, want = prefill_group(hf_model, kw, ctxs, cpu)
            rows, got = prefill_group(hf_model, kw, ctxs, cpu, fn)
        assert torch.allclose(got, want, atol=1e-4)
        for row, want_row, c in zip(rows, want_rows, ctxs, strict=True):
            assert row.length == len(c)
            for a, b in zip(row.keys + row.values, want_row.keys + want_row.values, strict=True):
                assert torch.allclose(a, b, atol=1e-4)


def test_lanes_bound_padding_and_keep_rows_in_order() -> None:
    lanes = Lanes(torch.device("cpu"), slack=4)
    reqs = [SimpleNamespace(rid=f"r{n}") for n in (10, 12, 500, 24, 30)]
    lanes.place([(r, _kv(int(r.rid[1:])), 0) for r in reqs])  # type: ignore[misc]
    widths = sorted(sorted(lane.batch.lengths) for lane in lanes.lanes)
    assert widths == [[10, 12, 24], [30], [500]]  # 30 > 2 * 10 + 4 opens a lane; 500 is alone
    for lane in lanes.lanes:
        assert [int(r.rid[1:]) for r in lane.reqs] == lane.batch.lengths
    found = lanes.find("r12")
    assert found is not None
    lane, i = found
    lane.drop([i])
    assert lanes.find("r12") is None and len(lanes) == 4
    assert len(lanes.clear()) == 4 and len(lanes) == 0


def _kv(n: int) -> RowKV:
    t = torch.arange(n, dtype=torch.float32).reshape(1, 1, n, 1)
    return RowKV([t, t + 1], [t + 2, t + 3])


def test_prefix_cache_longest_match_dominance_and_budget() -> None:
    c = PrefixCache(max_tokens=20)
    c.insert([1, 2, 3], _kv(3))
    c.insert([1, 2, 3, 4, 5], _kv(5))  # extends the first: replaces it
    assert len(c) == 1
    hit = c.lookup([1, 2, 3, 4, 9], limit=10)
    assert hit.length == 4 and hit.kv is not None and hit.kv.length == 4
    assert c.lookup([1, 2, 3, 4, 5], limit=4).length == 4
    assert c.lookup([7], limit=1).length == 0
    c.insert([7, 8, 9, 10, 11, 12, 13, 14, 15, 16], _kv(10))
    c.insert([20 + i for i in range(10)], _kv(10))  # over budget: the least recently used goes
    assert c.total_tokens <= 20 and c.lookup([1, 2], limit=2).length == 0
    with pytest.raises(ValueError, match="covers"):
        c.insert([1, 2], _kv(3))
