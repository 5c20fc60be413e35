"""The slot decode path (`server/slots.py`) on CPU, without CUDA graphs: requests decode in fixed slots
of a static KV cache (per-row positions, compaction when rows leave, eviction to the eager lanes when a
slot is full), and stay exact: greedy equals transformers' generate, logprobs equal a separate forward,
prefix reuse and export/import, weight updates in place; and the long slots' steps (rows pinned to their
slots, holes among them) change nothing but their running rows' next columns. `test_cuda_graphs.py` runs
the same checks with captured graphs on a GPU."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
import sys  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # the shared checks (tests run with --import-mode=importlib)
import slot_checks  # noqa: E402
from gyre_engine.server.engine import Engine  # noqa: E402
from gyre_engine.server.model_factory import create_model  # noqa: E402
from gyre_engine.server.serve import ServeConfig, load_engine  # noqa: E402
from gyre_engine.server.slots import SlotBatch, length_bucket  # noqa: E402


def _engine(model_dir: Path, **kw: Any) -> Engine:
    cfg = Engine.Config(max_running_requests=8, decode_slots="eager", **kw)
    return load_engine(ServeConfig(model=str(model_dir), device="cpu", engine=cfg))


@pytest.fixture(scope="module")
def engines(model_dir: Path) -> Iterator[tuple[Engine, Engine]]:
    a = _engine(model_dir, slot_max_len=48)  # small slots: long rows move on to the eager lanes
    b = _engine(model_dir)
    yield a, b
    a.shutdown()
    b.shutdown()


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_model(tmp_path_factory.mktemp("tiny-other") / "model", shape="tiny", seed=1)


def test_slot_engine_is_on_and_greedy_equals_generate(engines: tuple[Engine, Engine], hf_model: Any) -> None:
    a, _ = engines
    assert a.slots is not None and not a.slots.use_graphs
    slot_checks.check_concurrent_greedy(a, hf_model)
    st = a.slot_stats()
    assert st["eager_steps"] > 0
    assert a.stats().decode_steps > st["eager_steps"]  # some rows outgrew 48 tokens and went on in lanes


def test_slot_logprobs_equal_a_separate_forward(engines: tuple[Engine, Engine], hf_model: Any) -> None:
    slot_checks.check_logprobs(engines[1], hf_model)


def test_slot_prefix_reuse_and_export_import(engines: tuple[Engine, Engine], hf_model: Any) -> None:
    a, b = engines
    slot_checks.check_prefix_reuse_and_export(b, a, hf_model)


def test_slot_weight_update(engines: tuple[Engine, Engine], model_dir: Path, other_dir: Path) -> None:
    ref = slot_checks.load_hf(model_dir)
    slot_checks.check_weight_update(engines[1], ref, other_dir, model_dir)
    slot_checks.check_update_between_tokens(engines[1], other_dir)


def test_slot_rows_compact_and_keep_their_kv(hf_model: Any) -> None:
    """Rows leave from the middle: the last rows move into the holes with their KV and positions."""
    from gyre_engine.server.batch import cache_kwarg
    from gyre_engine.server.prefill import prefill_group

    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16], [17], [18, 19, 20]]
    with torch.inference_mode():
        rows, logits = prefill_group(hf_model, cache_kwarg(hf_model), prompts, torch.device("cpu"))
        sb = SlotBatch(hf_model, 8, 64, use_graphs=False)
        toks = logits.argmax(-1).tolist()
        sb.add_many(list(zip(rows, toks, strict=True)))
        ctxs = [[*p, t] for p, t in zip(prompts, toks, strict=True)]
        for step in range(6):
            if step == 2:
                order = sb.remove([0, 2])
                assert order == [3, 1, 4]
                ctxs = [ctxs[i] for i in order]
            out = sb.step()
            for i, ctx in enumerate(ctxs):
                want = hf_model(torch.tensor([ctx])).logits[0, -1]
                assert torch.allclose(out[i], want, atol=1e-4)
            for i in range(len(ctxs)):
                sb.next_tokens[i] = int(out[i].argmax())
                ctxs[i].append(sb.next_tokens[i])
        assert sb.lengths == [len(c) - 1 for c in ctxs]


def test_full_width_slots_are_exact_and_never_grow(model_dir: Path, hf_model: Any) -> None:
    """`slot_widths = "full"`: the buffer is allocated at its bound once and every step attends over all
    of it (tiles past a row's length skipped): the same greedy tokens as transformers' generate, and no
    grow however long the rows get."""
    eng = _engine(model_dir, slot_max_len=96, slot_widths="full")
    try:
        assert eng.slots is not None and eng.slots.full_width
        slot_checks.check_concurrent_greedy(eng, hf_model)
        st = eng.slot_stats()
        assert st["capacity"] == 96 and st["grows"] == 1  # the one allocation, at its bound
        assert st["eager_steps"] > 0
    finally:
        eng.shutdown()
    with pytest.raises(ValueError, match="slot_widths must be bucketed or full"):
        _engine(model_dir, slot_widths="wide")


def test_length_buckets() -> None:
    assert [length_bucket(n) for n in (1, 128, 129, 256, 257, 385, 1000, 5000)] == [
        128,
        128,
        256,
        256,
        384,
        512,
        1024,
        6144,
    ]


def test_greedy_runs_end_rows_inside_a_run_and_store_exact_prefixes(model_dir: Path, hf_model: Any) -> None:
    """Runs of 8 greedy steps per replay: a row whose budget or stop token falls inside a run stops
    there (the rest of the run is dropped), its KV is cut to what it kept, and the next call on that
    context reuses exactly that and equals a fresh prefill."""
    from gyre_engine.protocol import SamplingParams

    eng = _engine(model_dir, run_steps=8)
    try:
        assert eng.slots is not None
        ctx_a, ctx_b = slot_checks.SYSTEM + slot_checks.USER, [*slot_checks.TOOL, 7, 8]
        ref_b = slot_checks.reference_greedy(hf_model, ctx_b, 40)
        # a token first appearing at index >= 3: as a stop token it ends the row there, mid-run
        stop = next(t for t in ref_b[3:] if ref_b.index(t) >= 3)
        cut = ref_b.index(stop) + 1
        stop_params = SamplingParams(
            max_new_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[stop]
        )
        long = slot_checks.greedy_params(41)  # keeps the batch in runs of 8 while the others end
        outs = slot_checks.run_all(
            eng, [(ctx_a, slot_checks.greedy_params(13)), (ctx_b, stop_params), (slot_checks.SYSTEM, long)]
        )
        assert outs[0]["ids"] == slot_checks.reference_greedy(hf_model, ctx_a, 13)
        assert outs[2]["ids"] == slot_checks.reference_greedy(hf_model, slot_checks.SYSTEM, 41)
        assert outs[1]["ids"] == ref_b[:cut] and outs[1]["finish"].type == "stop"
        assert eng.slot_stats()["run_steps"] >= 32  # the long row's 40 decode tokens: five runs of 8
        # the stored prefixes are exactly the kept tokens (all but the last output token)
        for ctx, out in ((ctx_a, outs[0]["ids"]), (ctx_b, outs[1]["ids"])):
            follow = ctx + out + [9, 10, 11]
            got = slot_checks.run_all(eng, [(follow, slot_checks.greedy_params(12))])[0]
            assert got["cached"] == len(ctx) + len(out) - 1
            assert got["ids"] == slot_checks.reference_greedy(hf_model, follow, 12)
    finally:
        eng.shutdown()


def test_run_length_rule(model_dir: Path) -> None:
    """A run of `run_steps` steps only when some row wants at least three quarters of it and every
    row's slot has room; single steps otherwise."""
    from gyre_engine.server.request import EngineRequest, Running

    eng = _engine(model_dir, run_steps=8, slot_max_len=48)
    try:
        sb = eng.slots
        assert sb is not None

        def running(budget: int, made: int) -> Running:
            r = Running.__new__(Running)
            r.req = EngineRequest("x", [1, 2], slot_checks.greedy_params(budget))
            r.output = [0] * made
            return r

        sb.lengths = [10, 20]
        assert eng._run_length([running(20, 5), running(9, 4)], sb) == 8  # 15 left
        assert eng._run_length([running(10, 5), running(9, 4)], sb) == 1  # 5 left at most
        assert eng._run_length([running(10, 4), running(9, 4)], sb) == 8  # 6 = 3/4 of 8
        sb.lengths = [10, 41]  # 41 + 8 > 48: no room for a run
        assert eng._run_length([running(100, 0), running(100, 0)], sb) == 1
        sb.lengths = []
        eng.config.run_steps = 1
        sb.lengths = [10]
        assert eng._run_length([running(100, 0)], sb) == 1
        sb.lengths = []
    finally:
        eng.shutdown()


def test_sampled_rows_run_on_the_device_and_draw_what_the_host_draws(model_dir: Path, hf_model: Any) -> None:
    """Rows sampled at their temperature (seeded) decode in runs of 8 like greedy ones; their tokens
    equal those of single steps and of the host's `sample` (a top-p neighbour sends the batch there),
    and their logprobs are those of the tempered distribution."""
    from gyre_engine.protocol import SamplingParams

    runs, single = _engine(model_dir, run_steps=8), _engine(model_dir, run_steps=1)
    try:
        p = SamplingParams(max_new_tokens=30, temperature=0.8, sampling_seed=21, ignore_eos=True)
        q = SamplingParams(max_new_tokens=30, temperature=1.0, sampling_seed=5, ignore_eos=True)
        reqs = [(slot_checks.SYSTEM + slot_checks.USER, p), (slot_checks.TOOL, q)]
        a = slot_checks.run_all(runs, reqs, logprob=True)
        b = slot_checks.run_all(single, reqs, logprob=True)
        assert [o["ids"] for o in a] == [o["ids"] for o in b]
        assert runs.slot_stats()["run_steps"] >= 24 and single.slot_stats()["run_steps"] == 0
        trunc = SamplingParams(max_new_tokens=30, temperature=1.0, top_p=0.9, ignore_eos=True)
        c = slot_checks.run_all(runs, [*reqs, (slot_checks.USER, trunc)])
        assert [o["ids"] for o in c[:2]] == [o["ids"] for o in a]
        for (ids, sp), o in zip(reqs, a, strict=True):
            full = torch.tensor([ids + o["ids"]])
            with torch.no_grad():
                logits = hf_model(full).logits[0, len(ids) - 1 : -1].float()
            want = torch.log_softmax(logits / sp.temperature, -1).gather(-1, torch.tensor(o["ids"])[:, None])
            assert torch.allclose(torch.tensor(o["lps"]), want.squeeze(-1), atol=1e-4)
        assert len({tuple(o["ids"]) for o in a}) == 2 and len(set(a[0]["ids"])) > 5  # they do sample
    finally:
        runs.shutdown()
        single.shutdown()


SENTINEL = 1e4
"""A value no step writes into the KV (keys and values of the tiny model stay within a few units)."""


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["start", "stop", "step"]), st.integers(0, 3)), max_size=14))
@example(ops=[("start", 0), ("step", 0), ("stop", 0), ("start", 0), ("step", 0)])  # a write repeating one
def test_long_slots_steps_touch_only_their_running_rows(hf_model: Any, ops: list[tuple[str, int]]) -> None:
    """The long slots (`dedicated`): rows start in chosen slots, leave from anywhere, and each step (runs
    of 1 or 2) writes only its running rows' next columns; a slot that is free, held or being prefilled
    is a hole whose KV no step changes, and no row moves."""
    sb = SlotBatch(hf_model, 4, 48, use_graphs=False, dedicated=True)
    kv = sb.allocate()
    with torch.inference_mode():
        kv.copy_(torch.randn(kv.shape, generator=torch.Generator().manual_seed(0)))
    for op, arg in ops:
        free = [s for s in range(4) if s not in sb.slot_of]
        if op == "start" and free:
            sb.start_row(free[arg % len(free)], 5 + 3 * arg, 7 + arg)
        elif op == "stop" and sb.slot_of:
            sb.remove([arg % len(sb.slot_of)])
        elif op == "step" and sb.slot_of:
            steps = 1 + arg % 2
            old = dict(zip(sb.slot_of, sb.lengths, strict=True))
            with torch.inference_mode():  # the columns each row writes hold a value no step computes, so a
                for s, n in old.items():  # write shows even where it repeats an earlier one's values
                    kv[:, :, s, :, n : n + steps] = SENTINEL
            before = kv.clone()
            toks, _ = sb.step_run(steps)
            assert [len(t) for t in toks] == [len(sb.slot_of)] * steps
            for s in range(4):
                if s not in old:  # a hole: untouched
                    assert torch.equal(kv[:, :, s], before[:, :, s])
                    continue
                n = old[s]
                assert torch.equal(kv[:, :, s, :, :n], before[:, :, s, :, :n])  # its KV stays
                assert torch.equal(kv[:, :, s, :, n + steps :], before[:, :, s, :, n + steps :])
                assert not (kv[:, :, s, :, n : n + steps] == SENTINEL).any()  # every new column written
            assert sb.lengths == [old[s] + steps for s in sb.slot_of]
