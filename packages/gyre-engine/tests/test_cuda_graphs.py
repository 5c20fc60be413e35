"""The slot decode path on a GPU: the step captured as CUDA graphs per (batch, length) bucket over the
`torch.compile`d forward, replayed with per-row positions. Same exactness checks as the CPU slot tests
(greedy equals transformers' generate on the same GPU, logprobs equal a separate forward, prefix reuse
and export/import, weight updates in place while graphs stay captured, release/resume of weights
re-captures (after a one-step warm-up), the long slots' rows decoding as one batch). Float32 tiny model, so the reference and the graph path agree to ~1e-5. Skipped without
CUDA."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import sys  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # the shared checks (tests run with --import-mode=importlib)
import slot_checks  # noqa: E402
from gyre_engine.server.engine import Engine  # noqa: E402
from gyre_engine.server.model_factory import create_model  # noqa: E402
from gyre_engine.server.serve import ServeConfig, load_engine  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


def _engine(model_dir: Path, **kw: Any) -> Engine:
    cfg = Engine.Config(max_running_requests=16, decode_slots="graphs", **kw)
    return load_engine(ServeConfig(model=str(model_dir), device="cuda", engine=cfg))


@pytest.fixture(scope="module")
def ref(model_dir: Path) -> Any:
    return slot_checks.load_hf(model_dir).to("cuda")


@pytest.fixture(scope="module")
def engines(model_dir: Path) -> Iterator[tuple[Engine, Engine]]:
    a = _engine(model_dir)
    b = _engine(model_dir, slot_max_len=48, compile_decode=False)  # uncompiled graphs; small slots
    yield a, b
    a.shutdown()
    b.shutdown()


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_model(tmp_path_factory.mktemp("tiny-other") / "model", shape="tiny", seed=1)


def test_graphs_greedy_equals_generate(engines: tuple[Engine, Engine], ref: Any) -> None:
    for e in engines:
        slot_checks.check_concurrent_greedy(e, ref)
        st = e.slot_stats()
        assert st["graphs"] and st["replays"] > 0 and st["captures"] > 0, st
    assert engines[0].slot_stats()["compiled"], "the compiled forward fell back to eager"


def test_graphs_logprobs_equal_a_separate_forward(engines: tuple[Engine, Engine], ref: Any) -> None:
    slot_checks.check_logprobs(engines[0], ref, atol=2e-4)


def test_graphs_prefix_reuse_and_export_import(engines: tuple[Engine, Engine], ref: Any) -> None:
    a, b = engines
    slot_checks.check_prefix_reuse_and_export(a, b, ref)


def test_graphs_weight_update_in_place(
    engines: tuple[Engine, Engine], ref: Any, model_dir: Path, other_dir: Path
) -> None:
    a = engines[0]
    assert a.slots is not None
    graphs = dict(a.slots._graphs)
    slot_checks.check_weight_update(a, ref, other_dir, model_dir)
    slot_checks.check_update_between_tokens(a, other_dir)
    # copies into the parameters keep their addresses: the graphs captured before were kept and replayed
    assert graphs and all(a.slots._graphs.get(k) is g for k, g in graphs.items())


def test_graphs_release_and_resume(engines: tuple[Engine, Engine], ref: Any) -> None:
    a = engines[0]
    ids = slot_checks.SYSTEM + slot_checks.USER
    before = slot_checks.run_all(a, [(ids, slot_checks.greedy_params(16))])[0]["ids"]
    a.call(a.release_memory, None).result(60)
    a.call(a.resume_memory, None).result(60)
    assert slot_checks.run_all(a, [(ids, slot_checks.greedy_params(16))])[0]["ids"] == before


def test_graphs_captured_again_after_a_release_warm_up_one_step(engines: tuple[Engine, Engine]) -> None:
    """A release drops the graphs (the weights and KV move); each step shape that ran before is captured
    again after one eager step instead of two runs of its steps (uncompiled forward), and the replays
    decode the same tokens as the graphs captured before the release."""
    b = engines[1]
    reqs = [([1200 + 7 * i + k for i in range(10)], slot_checks.greedy_params(16)) for k in range(3)]
    before = [o["ids"] for o in slot_checks.run_all(b, reqs)]
    st0 = b.slot_stats()
    b.call(b.release_memory, None).result(60)
    b.call(b.resume_memory, None).result(60)
    after = [o["ids"] for o in slot_checks.run_all(b, reqs)]
    st1 = b.slot_stats()
    captures = st1["captures"] - st0["captures"]
    assert after == before
    assert captures > 0 and st1["graphs"], st1
    assert st1["warmup_steps"] - st0["warmup_steps"] == captures, (st0, st1)


@pytest.mark.parametrize(("compiled", "widths"), [(True, "bucketed"), (False, "full")])
def test_graphs_long_rows_decode_as_one_batch(model_dir: Path, ref: Any, compiled: bool, widths: str) -> None:
    """The long slots as one batch under CUDA graphs (runs of 8 steps): rows of different lengths start
    and end at different steps, with holes among the slots a step covers (a finished row's slot held by
    the prefix cache, a slot being prefilled), each equal to transformers' generate run alone; a
    follow-up takes its context's slot back (no copy). With full widths every graph was captured when the
    buffer was allocated (greedy rows: no sampled graph), none later."""
    e = _engine(
        model_dir,
        slot_max_len=64,
        long_context_tokens=1024,
        long_context_slots=3,
        prefill_chunk=64,
        compile_decode=compiled,
        slot_widths=widths,
    )
    a = [1000 + (i * 13) % 700 for i in range(300)]
    b = [1100 + (i * 17) % 600 for i in range(200)]
    c = [1500 + (i * 11) % 400 for i in range(150)]
    try:
        outs = slot_checks.run_all(
            e,
            [
                (a, slot_checks.greedy_params(5)),
                (b, slot_checks.greedy_params(90)),
                (c, slot_checks.greedy_params(40)),
            ],
        )
        follow = a + outs[0]["ids"] + slot_checks.TOOL
        again = slot_checks.run_all(e, [(follow, slot_checks.greedy_params(20))])[0]
        st = e.slot_stats()
    finally:
        e.shutdown()
    for p, n, o in zip((a, b, c), (5, 90, 40), outs, strict=True):
        assert o["ids"] == slot_checks.reference_greedy(ref, p, n)
    assert again["ids"] == slot_checks.reference_greedy(ref, follow, 20)
    assert again["cached"] == len(a) + 5 - 1
    assert st["long_slots"] == 3 and st["long_prefix_copies"] == 0, st
    assert st["long_replays"] > 0 and st["long_captures"] > 0 and st["long_run_steps"] > 0, st
    if widths == "full":  # batch buckets 1, 2 and 3, run lengths 1 and 8
        assert st["long_captures"] == 6, st
