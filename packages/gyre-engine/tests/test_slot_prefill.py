"""Packed prefills straight into free decode slots (`slot_prefill.py`) on the CPU, where the same pass runs
without graphs: the attention op writes each token's key/value at its slot and column and attends over
its slot up to it (padding tokens read nothing and write only their slot's last column), off Triton and
through Triton's interpreter; the pass gives each row the logits and KV of its context prefilled alone
and leaves running rows' slots untouched; and an engine serving agent-shaped calls through it gives
every call the tokens it gets without it, including a row of a pass that finishes at its first token
while the rows after it in the pass keep decoding."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
from gyre_engine.server.batch import RowKV, cache_from_layers, cache_kwarg, cache_layers  # noqa: E402
from gyre_engine.server.decode_attn import masked_reference  # noqa: E402
from gyre_engine.server.engine import Engine  # noqa: E402
from gyre_engine.server.serve import ServeConfig, load_engine  # noqa: E402
from gyre_engine.server.slot_prefill import SlotPrefill, token_buckets  # noqa: E402
from gyre_engine.server.slots import SlotBatch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # the shared helpers (tests run with --import-mode=importlib)
import slot_checks  # noqa: E402
from interpret import interpret  # noqa: E402


def prefill_case(seed: int, tokens: list[tuple[int, int]], pad: int, slots: int = 4) -> dict[str, Any]:
    """An op case: `tokens` (slot, valid columns) of real tokens, then `pad` padding tokens (valid 0) in
    the last real token's slot."""
    g = torch.Generator().manual_seed(seed)
    h, kvh, d, cap = 4, 2, 16, 48
    kv = torch.randn(2, 3, slots, kvh, cap, d, generator=g)
    t = len(tokens) + pad
    qkv = torch.randn(t, h + 2 * kvh, d, generator=g)  # one fused projection, as the model hands it
    slot = torch.tensor([s for s, _ in tokens] + [tokens[-1][0]] * pad)
    valid = torch.tensor([n for _, n in tokens] + [0] * pad)
    return {
        "query": qkv[:, :h],
        "new_key": qkv[:, h : h + kvh],
        "new_value": qkv[:, h + kvh :],
        "kv": kv,
        "layer": 1,
        "slot": slot,
        "valid": valid,
        "width": cap,
        "scale": d**-0.5,
    }


def prefill_reference(c: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every real token's key/value written by hand, padding's into its slot's last column, then each real
    token's attention over its slot (what the op must give for them) and the buffer the op must leave."""
    kv = c["kv"].clone()
    layer, cap = c["layer"], kv.shape[4]
    for i, (s, n) in enumerate(zip(c["slot"].tolist(), c["valid"].tolist(), strict=True)):
        col = n - 1 if n > 0 else cap - 1
        kv[0, layer, s, :, col] = c["new_key"][i]
        kv[1, layer, s, :, col] = c["new_value"][i]
    real = c["valid"] > 0
    k, v = kv[0, layer, c["slot"][real]], kv[1, layer, c["slot"][real]]
    return masked_reference(c["query"][real], k, v, c["valid"][real], c["scale"]), kv


CASES = [  # (slot, valid) per real token: two calls of 3 and 2 new tokens, one of 5, one token alone
    ([(1, 6), (1, 7), (1, 8), (3, 20), (3, 21)], 3),
    ([(0, 44), (0, 45), (0, 46), (0, 47), (2, 1)], 0),
    ([(2, 1)], 7),
]


@pytest.mark.parametrize("tokens,pad", CASES)
def test_slot_prefill_attention_writes_each_token_and_attends_its_slot(
    tokens: list[tuple[int, int]], pad: int
) -> None:
    c = prefill_case(0, tokens, pad)
    want, want_kv = prefill_reference(c)
    got = torch.ops.gyre.slot_prefill_attention(**c)
    real = c["valid"] > 0
    assert torch.allclose(got[real], want, atol=1e-6)
    layer = c["layer"]
    others = [i for i in range(c["kv"].shape[1]) if i != layer]
    assert torch.equal(c["kv"][:, layer, :, :, :-1], want_kv[:, layer, :, :, :-1])
    assert torch.equal(c["kv"][:, others], want_kv[:, others])  # other layers untouched
    assert bool(torch.isfinite(got).all())


@pytest.mark.slow
def test_slot_prefill_attention_on_triton_equals_the_reference_in_the_interpreter() -> None:
    """The decode kernel with query rows mapped to slots (`triton_decode_attention(slots=...)`), inside
    the op: several splits or one, tokens of one call reading the columns written for the tokens before
    them in the same op."""
    out = interpret(
        f"""
        import torch
        import test_slot_prefill as t
        from gyre_engine.server import decode_attn
        assert decode_attn.triton_available(torch.device("cpu"))
        for seed, (tokens, pad) in enumerate({CASES!r}):
            for target in (decode_attn.TARGET_PROGRAMS, 1 << 20):
                decode_attn.TARGET_PROGRAMS = target
                c = t.prefill_case(seed, tokens, pad)
                want, want_kv = t.prefill_reference(c)
                got = torch.ops.gyre.slot_prefill_attention(**c)
                real = c["valid"] > 0
                err = float((got[real] - want).abs().max())
                assert err < 1e-5, err
                assert torch.equal(c["kv"][:, :, :, :, :-1], want_kv[:, :, :, :, :-1])
                assert bool(torch.isfinite(got).all())
        print("ok")
        """,
        timeout=300,
    )
    assert out.strip().endswith("ok")


def test_token_buckets() -> None:
    assert token_buckets(256) == [32, 64, 128, 256]
    assert token_buckets(100) == [32, 64, 100]
    assert token_buckets(32) == [32] and token_buckets(10) == [10] and token_buckets(0) == []


def alone(model: Any, ids: list[int]) -> tuple[RowKV, torch.Tensor]:
    cache = cache_from_layers([], [])
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), use_cache=True, **{cache_kwarg(model): cache})
    return RowKV(*cache_layers(cache)), out.logits[0, -1]


@settings(max_examples=5, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 20)), min_size=1, max_size=3),
    running=st.integers(0, 2),
)
def test_a_pass_gives_each_row_its_context_prefilled_alone(
    hf_model: Any, rows: list[tuple[int, int]], running: int
) -> None:
    """Rows of (cached, new) tokens prefilled together into the free slots after `running` running rows:
    each row's last logits and its slot's KV are those of its context prefilled alone, the running rows'
    slots are untouched, and a row started in its slot decodes as it would alone."""
    slots = SlotBatch(hf_model, slots=6, max_len=64, use_graphs=False, full_width=True)
    sp = SlotPrefill(slots, 64)
    slots.allocate()
    for i in range(running):
        kv, logits = alone(hf_model, [300 + 5 * i + j for j in range(10 + i)])
        slots.add(kv, int(logits.argmax()))
    before = slots.kv[:, :, :running].clone()
    ctxs = [[700 + 29 * i + 3 * j for j in range(c + n)] for i, (c, n) in enumerate(rows)]
    assert sp.fits([(len(c), n) for c, (_, n) in zip(ctxs, rows, strict=True)])
    prefixes = [alone(hf_model, c[:cached])[0] for c, (cached, _) in zip(ctxs, rows, strict=True)]
    logits, got = sp.run([(kv, c, cached) for kv, c, (cached, _) in zip(prefixes, ctxs, rows, strict=True)])
    assert torch.equal(slots.kv[:, :, :running], before)
    for i, (c, lg, row) in enumerate(zip(ctxs, logits, got, strict=True)):
        kv, want = alone(hf_model, c)
        assert row.slot == running + i and row.length == len(c)
        assert torch.allclose(lg, want, atol=1e-4)
        for a, b in zip(row.keys + row.values, kv.keys + kv.values, strict=True):
            assert torch.allclose(a, b, atol=1e-4)
    c, row = ctxs[-1], got[-1]
    nxt = int(logits[-1].argmax())
    slots.start_row(row.slot, row.length, nxt)  # the rows before it finished at once: it moves down
    assert slots.slot_of[-1] == running
    step = slots.step(hf_model)
    assert torch.allclose(step[-1], alone(hf_model, [*c, nxt])[1], atol=1e-4)


def test_fits_only_what_one_pass_serves(hf_model: Any) -> None:
    slots = SlotBatch(hf_model, slots=3, max_len=64, use_graphs=False, full_width=True)
    sp = SlotPrefill(slots, 64)
    slots.allocate()
    assert sp.fits([(40, 30), (50, 34)])
    assert not sp.fits([(40, 30), (50, 35)])  # 65 new tokens: past the largest bucket
    assert sp.fits([(63, 5)]) and not sp.fits([(64, 5)])  # a column left to decode into
    assert not sp.fits([(10, 1)] * 4)  # three free slots
    assert not sp.fits([])
    with pytest.raises(ValueError, match="full-width"):
        SlotPrefill(SlotBatch(hf_model, slots=3, max_len=64, use_graphs=False), 64)


def test_an_engine_serves_agent_calls_through_it_as_without_it(model_dir: Path) -> None:
    """`slot_checks.agent_calls`: every call's tokens equal those of an engine that prefills them as before,
    and the next calls ran as one pass into the slots."""

    def make(tokens: int) -> Engine:
        cfg = slot_checks.slot_prefill_config(tokens, "eager", 128)
        return load_engine(ServeConfig(model=str(model_dir), device="cpu", engine=cfg))

    with_it, without = slot_checks.check_agent_calls_with_and_without_slot_prefill(make)
    assert with_it["after"]["prefill_eager"] - with_it["before"]["prefill_eager"] == 1, with_it
    assert "prefill_eager" not in without["after"]


def test_a_negative_token_bound_is_refused(model_dir: Path) -> None:
    cfg = Engine.Config(prefill_graph_tokens=-1)
    with pytest.raises(ValueError, match="prefill_graph_tokens must be >= 0"):
        load_engine(ServeConfig(model=str(model_dir), device="cpu", engine=cfg))


def test_the_slots_count_every_time_their_graphs_go(hf_model: Any) -> None:
    """What the graphed passes go by (`SlotBatch.graph_epoch`): it moves when the buffer is freed without
    kept addresses and when a parameter moved, and not for a weight check that found nothing moved."""
    slots = SlotBatch(hf_model, slots=2, max_len=32, use_graphs=False, full_width=True)
    slots.allocate()
    e0 = slots.graph_epoch
    slots.check_weights()  # the first check records the weights' addresses
    e1 = slots.graph_epoch
    slots.check_weights()
    assert slots.graph_epoch == e1 >= e0
    slots.release()
    assert slots.graph_epoch == e1 + 1
    p = next(hf_model.parameters())
    old = p.data
    try:
        p.data = old.clone()  # a parameter at another address, as after a release of the weights
        slots.check_weights()
        assert slots.graph_epoch == e1 + 2
    finally:
        p.data = old
