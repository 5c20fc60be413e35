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


def test_abort_request_names_one_request_not_its_rid(engine: Engine) -> None:
    """The abort a server sends for a client that left names that request: a later request reusing the
    rid, admitted before the abort lands, keeps running (`abort` by rid would end it)."""
    finishes: dict[int, list[str]] = {0: [], 1: []}
    done = threading.Event()

    def sink_of(i: int) -> Callable[[TokenEvent], None]:
        def sink(ev: TokenEvent) -> None:
            if ev.finish is not None:
                finishes[i].append(ev.finish.type)
                if i == 1:
                    done.set()

        return sink

    sp = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    first = EngineRequest("twin", USER, SamplingParams(max_new_tokens=1, temperature=0.0))
    engine.submit(first, sink_of(0)).result(30)
    second = EngineRequest("twin", USER, sp)
    while not finishes[0]:
        threading.Event().wait(0.01)
    engine.submit(second, sink_of(1)).result(30)
    assert engine.call(engine.abort_request, first).result(30) is False
    assert done.wait(60)
    assert finishes == {0: ["length"], 1: ["length"]}
    running = EngineRequest(
        "solo", USER, SamplingParams(max_new_tokens=30000, temperature=0.0, ignore_eos=True)
    )
    gone = threading.Event()
    engine.submit(running, lambda ev: gone.set() if ev.finish is not None else None).result(30)
    assert engine.call(engine.abort_request, running).result(30) is True
    assert gone.wait(30)


def test_a_call_cancelled_before_it_runs_is_dropped_and_the_engine_lives_on(engine: Engine) -> None:
    """A server cancels its wait on a call when the wait times out or the client leaves; the engine
    thread must drop such a call, not die setting a result on a cancelled future (found by the fuzzer:
    the thread died and every later request was 409 'engine thread is not running')."""
    hold, held = threading.Event(), threading.Event()

    def block() -> None:
        held.set()
        hold.wait(30)

    ran: list[str] = []
    first = engine.call(block)
    assert held.wait(30)
    dropped = engine.call(ran.append, "dropped")
    assert dropped.cancel()
    hold.set()
    first.result(30)
    assert engine.call(ran.append, "kept").result(30) is None
    assert ran == ["kept"] and engine.alive


def test_calls_extending_cached_contexts_are_prefilled_in_one_packed_pass(
    engine: Engine, greedy: Callable[[list[int], int], list[int]]
) -> None:
    """Three calls, each extending a context the engine served before by a few new tokens (an agent's
    next call), admitted in one step: their rests are prefilled in one pass, and each continues exactly
    as transformers' generate does on its whole context."""
    sp1 = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    contexts = [[1100 + 11 * k + j for j in range(n)] for k, n in enumerate((9, 14, 5))]
    for k, ctx in enumerate(contexts):  # served once: each context is in the prefix cache after
        done = threading.Event()
        engine.submit(
            EngineRequest(f"prime-{k}", ctx, sp1), lambda ev, d=done: d.set() if ev.finish else None
        ).result(30)
        assert done.wait(30)
    calls = [ctx + [1500 + k, 1600 + k, 1700 + k][: 2 + k % 2] for k, ctx in enumerate(contexts)]
    outs: dict[str, list[int]] = {f"next-{k}": [] for k in range(len(calls))}
    done = {rid: threading.Event() for rid in outs}

    def sink(ev: TokenEvent) -> None:
        outs[ev.rid].extend(ev.token_ids)
        if ev.finish is not None:
            done[ev.rid].set()

    hold, held = threading.Event(), threading.Event()
    blocker = engine.call(lambda: (held.set(), hold.wait(30)))  # the engine thread waits inside a call
    assert held.wait(30)
    before = engine.stats()
    sp = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    taken = [engine.submit(EngineRequest(rid, ids, sp), sink) for rid, ids in zip(outs, calls, strict=True)]
    hold.set()  # the three are queued behind the blocker: the next step admits them together
    blocker.result(30)
    for f in taken:
        f.result(30)
    assert all(e.wait(60) for e in done.values())
    after = engine.stats()
    for rid, ids in zip(outs, calls, strict=True):
        assert outs[rid] == greedy(ids, 6), rid
    assert after.prefill_passes - before.prefill_passes == 1  # one packed pass for the three
    assert after.prefill_tokens_cached - before.prefill_tokens_cached >= sum(len(c) for c in contexts)
    assert after.prefill_tokens_computed - before.prefill_tokens_computed <= sum(
        len(c) - len(p) + 1 for c, p in zip(calls, contexts, strict=True)
    )
