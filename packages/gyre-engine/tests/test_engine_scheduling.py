"""Scheduling inside one in-process engine: a long prompt is prefilled chunk by chunk while running
requests keep decoding, and both come out exactly as transformers' generate."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from gyre_engine.protocol import SamplingParams

torch = pytest.importorskip("torch")
from gyre_engine.server.engine import Engine  # noqa: E402
from gyre_engine.server.request import EngineRequest, TokenEvent  # noqa: E402
from gyre_engine.server.serve import ServeConfig, load_engine  # noqa: E402

USER = [1200 + i * 7 for i in range(9)]
LONG_PROMPT = [1000 + (i * 13) % 700 for i in range(200)]


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[Engine]:
    e = load_engine(ServeConfig(model=str(model_dir), device="cpu", engine=Engine.Config(prefill_chunk=16)))
    yield e
    e.shutdown()


def test_long_prefill_is_chunked_across_steps_while_others_decode(
    engine: Engine, greedy: Callable[[list[int], int], list[int]]
) -> None:
    order: list[str] = []
    outs: dict[str, list[int]] = {"short": [], "long": []}
    done = {k: threading.Event() for k in outs}
    first_short = threading.Event()

    def sink(ev: TokenEvent) -> None:
        order.append(ev.rid)
        outs[ev.rid].extend(ev.token_ids)
        first_short.set()
        if ev.finish is not None:
            done[ev.rid].set()

    sp = SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)
    engine.submit(EngineRequest("short", USER, sp), sink).result(30)
    assert first_short.wait(30)
    engine.submit(
        EngineRequest(
            "long", LONG_PROMPT, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
        ),
        sink,
    ).result(30)
    assert done["short"].wait(60) and done["long"].wait(60)
    # 200 prompt tokens at 16 per step: about 13 steps of prefill, each also decoding "short"
    before_long = order[: order.index("long")]
    assert before_long.count("short") >= 12
    assert outs["short"] == greedy(USER, 60)
    assert outs["long"] == greedy(LONG_PROMPT, 8)
