"""Decode attention (`server/decode_attn.py`): the torch reference against transformers-style attention
(KV heads repeated, boolean mask), the split plan, and the Triton kernels themselves run on the CPU
through Triton's interpreter (a subprocess with TRITON_INTERPRET=1), alone and inside the slot engine.
The decode head's Triton kernels (`server/head.py`) against the torch head, in the interpreter too.
The interpreter computes float32 (its bf16 dot is not usable); the GPU runs them in bf16
(`tests/test_cuda_graphs.py` on CUDA, `bench/kernels_b64.py`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
from gyre_engine.server.decode_attn import masked_reference, plan_splits  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # the shared helpers (tests run with --import-mode=importlib)
from interpret import interpret  # noqa: E402


@settings(max_examples=300, deadline=None)
@given(
    batch=st.integers(1, 128),
    kv_heads=st.integers(1, 16),
    width=st.integers(1, 16384),
    block_n=st.sampled_from([32, 64, 128]),
    target=st.sampled_from([256, 1024, 4096]),
    max_tiles=st.sampled_from([0, 1, 4, 8, 32]),
)
def test_plan_splits_cover_the_width_in_whole_tiles(
    batch: int, kv_heads: int, width: int, block_n: int, target: int, max_tiles: int
) -> None:
    splits, chunk = plan_splits(batch, kv_heads, width, block_n, target, max_tiles)
    assert splits >= 1 and chunk % block_n == 0
    assert splits * chunk >= width and (splits - 1) * chunk < width  # every column, no empty split
    tiles = -(-width // block_n)
    want = -(-target // (batch * kv_heads))  # splits that would launch `target` programs
    assert splits <= tiles
    assert 2 * splits >= min(tiles, want)  # whole tiles per chunk cost at most half of the splits
    if max_tiles:  # no program walks more than max_tiles tiles
        assert chunk <= max_tiles * block_n


def test_plan_splits_bound_the_chunk_only_when_asked() -> None:
    """16 rows over 12,288 columns (full-width slots): the target alone gives chunks of 48 tiles."""
    assert plan_splits(16, 8, 12288, 64, 512) == (4, 3072)
    assert plan_splits(16, 8, 12288, 64, 512, 8) == (24, 512)
    assert plan_splits(64, 8, 384, 64, 512, 8) == (1, 384)  # a batch of short rows: one chunk as before


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_reference_equals_repeated_kv_attention(groups: int) -> None:
    torch.manual_seed(groups)
    b, kvh, d, width = 5, 2, 16, 37
    h = kvh * groups
    q = torch.randn(b, h, d, dtype=torch.float64)
    kv = torch.randn(2, b + 3, kvh, 64, d, dtype=torch.float64)  # a slot buffer: rows, heads, columns
    k, v = kv[0, :b, :, :width], kv[1, :b, :, :width]
    valid = torch.tensor([1, 37, 20, 5, 36])
    got = masked_reference(q, k, v, valid, d**-0.5)
    mask = torch.arange(width)[None, :] < valid[:, None]
    want = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None],
        k.repeat_interleave(groups, dim=1),  # transformers' repeat_kv order: head k*G + j uses KV head k
        v.repeat_interleave(groups, dim=1),
        attn_mask=mask[:, None, None, :],
        scale=d**-0.5,
    )[:, :, 0]
    assert torch.allclose(got, want, atol=1e-12)


@pytest.mark.slow
def test_triton_kernels_equal_the_reference_in_the_interpreter() -> None:
    """Several splits or one, a width that is not a whole number of tiles, rows attending one column or
    all of them, one to four query heads per KV head, a strided query as transformers hands it over;
    and with the step's own key/value (slices of one fused projection, as the model hands them over),
    which the kernel attends and writes into the buffer."""
    out = interpret(
        """
        import torch
        from gyre_engine.server.decode_attn import masked_reference, plan_splits, triton_available
        assert triton_available(torch.device("cpu"))
        torch.manual_seed(0)
        cases = [  # batch, heads, kv heads, head dim, capacity, width, target programs
            (3, 4, 2, 32, 256, 200, 1024), (4, 8, 2, 64, 128, 128, 8), (2, 2, 2, 16, 64, 50, 1024),
            (5, 4, 4, 32, 512, 300, 64),
        ]
        for b, h, kvh, d, cap, width, target in cases:
            q = torch.randn(b, 1, h, d).transpose(1, 2)[:, :, 0]  # strided, head dim contiguous
            kv = torch.randn(2, 3, b + 2, kvh, cap, d)
            k, v = kv[0, 1, :b, :, :width], kv[1, 1, :b, :, :width]
            valid = torch.randint(1, width + 1, (b,))
            valid[0], valid[-1] = 1, width
            from gyre_engine.server.decode_attn import triton_decode_attention
            got = triton_decode_attention(q, k, v, valid, d ** -0.5, target=target)
            want = masked_reference(q, k, v, valid, d ** -0.5)
            err = float((got - want).abs().max())
            print(b, h, kvh, width, plan_splits(b, kvh, width, target=target), err)
            assert err < 1e-5, err
        import test_decode_attn as t
        for seed, (b, h, kvh, d, cap, width, target) in enumerate(cases):
            for tgt in (target, 1 << 20):  # several splits (where the width allows), and one
                c = t._slot_case(seed, b, h, kvh, d, cap, width)
                want, want_kv = t._slot_reference(c)
                key, value = c["kv"][0, 1, :b, :, :width], c["kv"][1, 1, :b, :, :width]
                got = triton_decode_attention(
                    c["query"], key, value, c["valid"], c["scale"], target=tgt,
                    new_key=c["new_key"], new_value=c["new_value"],
                )
                err = float((got - want).abs().max())
                print("slot", b, width, plan_splits(b, kvh, width, target=tgt), err)
                assert err < 1e-5 and torch.equal(c["kv"], want_kv), err
                c = t._slot_case(seed, b, h, kvh, d, cap, width)
                got = torch.ops.gyre.slot_decode_attention(**c)  # the op takes the Triton path here
                assert float((got - want).abs().max()) < 1e-5 and torch.equal(c["kv"], want_kv)
            c, live, want, want_kv = t._hole_case(seed, b, h, kvh, d, cap, width)
            got = torch.ops.gyre.slot_decode_attention(**c)  # holes (valid 0): nothing read or written
            assert float((got[live] - want).abs().max()) < 1e-5 and torch.equal(c["kv"], want_kv)
            assert bool(torch.isfinite(got).all())  # a hole's output stays finite (its head's token too)
        print("ok")
        """,
        timeout=300,
    )
    assert out.strip().endswith("ok")


def _slot_case(seed: int, b: int, h: int, kvh: int, d: int, cap: int, width: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, 3, b + 2, kvh, cap, d, generator=g)
    valid = torch.randint(1, width + 1, (b,), generator=g)
    valid[0], valid[-1] = 1, width
    qkv = torch.randn(b, h + 2 * kvh, d, generator=g)  # one fused projection, as the model hands it
    return {
        "query": qkv[:, :h],
        "new_key": qkv[:, h : h + kvh],
        "new_value": qkv[:, h + kvh :],
        "kv": kv,
        "layer": 1,
        "valid": valid,
        "width": width,
        "scale": d**-0.5,
    }


def _slot_reference(c: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The new key/value written by hand, then attention over the buffer: what the op must equal."""
    kv = c["kv"].clone()
    for i, n in enumerate(c["valid"].tolist()):
        kv[0, c["layer"], i, :, n - 1] = c["new_key"][i]
        kv[1, c["layer"], i, :, n - 1] = c["new_value"][i]
    b, w = c["query"].shape[0], c["width"]
    k, v = kv[0, c["layer"], :b, :, :w], kv[1, c["layer"], :b, :, :w]
    return masked_reference(c["query"], k, v, c["valid"], c["scale"]), kv


def _hole_case(
    seed: int, b: int, h: int, kvh: int, d: int, cap: int, width: int
) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor, torch.Tensor]:
    """A slot case whose first row (and every other one past it) is a hole, valid 0: (the case, the
    running rows, their output and the buffer the op must leave: theirs written, the holes' untouched)."""
    c = _slot_case(seed, b, h, kvh, d, cap, width)
    live = torch.tensor([i % 2 == 1 for i in range(b)])
    c["valid"][~live] = 0
    live_case = {**c, "query": c["query"][live], "new_key": c["new_key"][live]}
    live_case |= {"new_value": c["new_value"][live], "valid": c["valid"][live]}
    slot = live.nonzero()[:, 0]
    kv = c["kv"].clone()
    for i, n in zip(slot.tolist(), c["valid"][live].tolist(), strict=True):
        kv[0, c["layer"], i, :, n - 1] = c["new_key"][i]
        kv[1, c["layer"], i, :, n - 1] = c["new_value"][i]
    k, v = kv[0, c["layer"], slot, :, :width], kv[1, c["layer"], slot, :, :width]
    want = masked_reference(live_case["query"], k, v, live_case["valid"], c["scale"])
    return c, live, want, kv


def test_slot_decode_attention_leaves_holes_untouched() -> None:
    """Rows at valid 0 (holes: long slots free, being prefilled or held by the prefix cache) off Triton:
    nothing of their slots is written, and the running rows beside them get what they get alone."""
    c, live, want, want_kv = _hole_case(0, 5, 4, 2, 16, 64, 40)
    got = torch.ops.gyre.slot_decode_attention(**c)
    assert torch.allclose(got[live], want, atol=1e-6)
    assert torch.equal(c["kv"], want_kv)
    assert bool(torch.isfinite(got).all())


def test_slot_decode_attention_writes_the_new_key_value_and_attends() -> None:
    """The op off Triton (what the CPU engine runs): each row's new key/value land at its last valid
    column of its slot at that layer, nothing else in the buffer changes, and the output attends them."""
    c = _slot_case(0, 4, 4, 2, 16, 64, 40)
    want, want_kv = _slot_reference(c)
    got = torch.ops.gyre.slot_decode_attention(**c)
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.equal(c["kv"], want_kv)


@pytest.mark.long  # about a minute in Triton's CPU interpreter; the kernels' equality tests stay in the default run
def test_slot_engine_with_the_triton_kernel_equals_generate(model_dir: Path) -> None:
    """The slot engine on the CPU with the Triton attention kernel (interpreted): concurrent rows of
    different lengths and budgets, greedy runs and single steps, each equal to transformers' generate."""
    out = interpret(
        f"""
        import slot_checks
        from gyre_engine.server.engine import Engine
        from gyre_engine.server.serve import ServeConfig, load_engine
        cfg = Engine.Config(max_running_requests=8, decode_slots="eager")
        eng = load_engine(ServeConfig(model={str(model_dir)!r}, device="cpu", engine=cfg))
        try:
            slot_checks.check_concurrent_greedy(eng, slot_checks.load_hf({str(model_dir)!r}))
            st = eng.slot_stats()
            assert st["eager_steps"] > 0 and st["run_steps"] > 0, st
        finally:
            eng.shutdown()
        print("ok")
        """,
        timeout=400,
    )
    assert out.strip().endswith("ok")


@pytest.mark.slow
def test_the_triton_head_equals_the_torch_head_in_the_interpreter() -> None:
    """Each row's token and logprob equal the torch head's (what `sampling.sample` computes): the argmax
    for greedy rows, the same seeded Gumbel-max draw for sampled rows, ties to the first index across
    chunks, a vocabulary that is not a whole number of chunks; the tokens also land in the next inputs."""
    out = interpret(
        """
        import torch
        from gyre_engine.server.head import decode_head
        from gyre_engine.server.slots import _greedy_head, _sampled_head
        torch.manual_seed(0)
        for vocab, chunk, block in ((5000, 1024, 256), (2048, 2048, 512), (700, 256, 256)):
            b = 6
            logits = torch.randn(b, vocab + 3)[:, :vocab] * 3  # a padded vocabulary, as the lm head gives it
            logits[1, 17] = logits[1, vocab - 5] = logits[1].max() + 1.0  # a tie across chunks: first wins
            temps = torch.tensor([1.0, 1.0, 0.7, 1.0, 1.3, 1.0])
            mask = torch.tensor([0, 0, 1, 1, 1, 0])
            seeds = torch.tensor([5, 9, 2**61 + 3, 11, 12, 4])
            pos = torch.tensor([0, 4, 100, 7, 7, 2**20])
            ids = torch.zeros(b, dtype=torch.long)
            got = decode_head(logits, temps, mask, seeds, pos, next_ids=ids, chunk=chunk, block=block)
            tok, lp = _sampled_head(logits, temps, mask, seeds, pos + 1)
            assert got[0].long().tolist() == tok.tolist(), (got[0], tok)
            assert torch.equal(ids, tok)
            assert float((got[1] - lp.double()).abs().max()) < 1e-5, (got[1], lp)
            assert got[0, 1] == 17
            g_tok, g_lp = _greedy_head(logits[mask == 0])
            assert got[0][mask == 0].long().tolist() == g_tok.tolist()
            print(vocab, chunk, got[0].long().tolist())
        print("ok")
        """,
        timeout=300,
    )
    assert out.strip().endswith("ok")


@pytest.mark.long  # a minute or two in Triton's CPU interpreter
def test_long_slots_with_the_triton_kernels_equal_generate(model_dir: Path) -> None:
    """The long slots as one batch on the CPU with the Triton attention and head kernels (interpreted),
    runs of 4 steps: long rows that start and end at different steps, a finished row's slot a hole held
    by the prefix cache while the others decode, each equal to transformers' generate; a follow-up takes
    the held slot back (no copy)."""
    out = interpret(
        f"""
        import slot_checks
        from gyre_engine.server.engine import Engine
        from gyre_engine.server.serve import ServeConfig, load_engine
        cfg = Engine.Config(
            decode_slots="eager", slot_max_len=64, long_context_tokens=512, long_context_slots=3,
            prefill_chunk=64, run_steps=4,
        )
        eng = load_engine(ServeConfig(model={str(model_dir)!r}, device="cpu", engine=cfg))
        ref = slot_checks.load_hf({str(model_dir)!r})
        a = [1000 + (i * 13) % 700 for i in range(200)]
        b = [1100 + (i * 17) % 600 for i in range(150)]
        c = [1500 + (i * 11) % 400 for i in range(100)]
        budgets = (3, 30, 14)
        try:
            outs = slot_checks.run_all(eng, [(p, slot_checks.greedy_params(n)) for p, n in zip((a, b, c), budgets)])
            follow = a + outs[0]["ids"] + slot_checks.TOOL
            again = slot_checks.run_all(eng, [(follow, slot_checks.greedy_params(9))])[0]
            st = eng.slot_stats()
        finally:
            eng.shutdown()
        for p, n, o in zip((a, b, c), budgets, outs):
            assert o["ids"] == slot_checks.reference_greedy(ref, p, n), (o["ids"], slot_checks.reference_greedy(ref, p, n))
        assert again["ids"] == slot_checks.reference_greedy(ref, follow, 9)
        assert again["cached"] == len(a) + budgets[0] - 1
        assert st["long_prefix_copies"] == 0 and st["long_run_steps"] > 0, st
        print("ok")
        """,
        timeout=600,
    )
    assert out.strip().endswith("ok")
