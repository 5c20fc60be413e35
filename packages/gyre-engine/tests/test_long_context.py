"""Long slots on the CPU with the tiny model: a context too long for a decode slot is prefilled chunk by
chunk into a long slot's buffer and decodes there, exactly as an unchunked prefill in the lanes (same
greedy tokens, logprobs within float tolerance); the next call that extends it reuses the buffer through
the prefix cache; a short request admitted while a long prefill is under way keeps getting tokens
before the long one's first; and a long request that must wait (every long slot busy, or the chunked
prefill taken) holds its place in the queue without holding up the short requests behind it, while the
requests that need a long slot or the chunked prefill keep their order. The long slots are one batch:
concurrent long rows decode in one step (one lane step, k tokens), each exactly as served alone; a
slot that is free, prefilled or held by the prefix cache is a hole that the step leaves untouched; a
follow-up takes over its context's slot without a copy; request N + 1 waits for one of N slots."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from gyre_base.testing import until
from gyre_engine.protocol import SamplingParams

torch = pytest.importorskip("torch")
from gyre_engine.server.batch import LongRowKV  # noqa: E402
from gyre_engine.server.engine import Engine, EngineUnavailable  # noqa: E402
from gyre_engine.server.request import EngineRequest, TokenEvent  # noqa: E402
from gyre_engine.server.serve import ServeConfig, load_engine  # noqa: E402
from gyre_engine.server.slots import SlotBatch  # noqa: E402

SYSTEM = [1000 + (i * 13) % 700 for i in range(300)]
USER = [1800 + i * 7 for i in range(9)]
TOOL = [1900 + (i * 11) % 140 for i in range(150)]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


@dataclass
class Call:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cached: int = -1
    finish: str | None = None
    done: threading.Event = field(default_factory=threading.Event)


def run(
    engine: Engine,
    calls: dict[str, tuple[list[int], SamplingParams]],
    order: list[str] | None = None,
    together: bool = False,
) -> dict[str, Call]:
    """Submit every call (in the given order; with `together`, all before the engine's next step);
    wait for all of them."""
    out = submit(engine, calls, order, together)
    for c in out.values():
        assert c.done.wait(120)
    return out


def submit(
    engine: Engine,
    calls: dict[str, tuple[list[int], SamplingParams]],
    order: list[str] | None = None,
    together: bool = False,
) -> dict[str, Call]:
    """Submit every call in the given order (with `together`, while the engine thread is held, so that
    all of them are queued before its next step); returns their records, filled as events come."""
    out = {rid: Call() for rid in calls}

    def sink(ev: TokenEvent) -> None:
        c = out[ev.rid]
        if order is not None:
            order.append(ev.rid)
        c.tokens.extend(ev.token_ids)
        c.logprobs.extend(ev.logprobs)
        c.cached = ev.cached_tokens
        if ev.finish is not None:
            c.finish = ev.finish.type
            c.done.set()

    hold = threading.Event()
    held = engine.call(hold.wait, 30) if together else None
    try:
        queued = [engine.submit(EngineRequest(rid, ids, sp), sink) for rid, (ids, sp) in calls.items()]
    finally:
        hold.set()
    if held is not None:
        assert held.result(30)
    for f in queued:
        f.result(30)
    return out


def assert_as_served_alone(got: dict[str, Call], ref: dict[str, Call]) -> None:
    """Each call's tokens equal its reference's, and its logprobs within 1e-4."""
    for rid, c in got.items():
        assert c.tokens == ref[rid].tokens, rid
        assert c.logprobs == pytest.approx(ref[rid].logprobs, abs=1e-4), rid


def make(model_dir: Path, **kw: object) -> Engine:
    return load_engine(ServeConfig(model=str(model_dir), device="cpu", engine=Engine.Config(**kw)))  # type: ignore[arg-type]


def with_long_slots(model_dir: Path, slots: int, **kw: object) -> Engine:
    """Decode slots of 64 tokens (eager) and `slots` long slots of 1024."""
    return make(
        model_dir,
        decode_slots="eager",
        slot_max_len=64,
        long_context_tokens=1024,
        long_context_slots=slots,
        **kw,
    )


@pytest.fixture(scope="module")
def long_engine(model_dir: Path) -> Iterator[Engine]:
    """Slots of 64 tokens, one long slot of 1024, chunks of 32 tokens."""
    e = make(
        model_dir,
        decode_slots="eager",
        slot_max_len=64,
        long_context_tokens=1024,
        prefill_chunk=32,
        run_steps=4,
    )
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def plain_engine(model_dir: Path) -> Iterator[Engine]:
    """The reference: unchunked prefill (one pass for the whole prompt), decode in the lanes."""
    e = make(model_dir, decode_slots="off", prefill_chunk=8192, enable_prefix_cache=False)
    yield e
    e.shutdown()


def test_long_slot_equals_unchunked_prefill_and_carries_the_context(
    long_engine: Engine, plain_engine: Engine, greedy: Callable[[list[int], int], list[int]]
) -> None:
    first = SYSTEM + USER
    got = run(long_engine, {"a1": (first, GREEDY)})["a1"]
    ref = run(plain_engine, {"r1": (first, GREEDY)})["r1"]
    assert got.tokens == ref.tokens == greedy(first, 12)
    assert got.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    assert got.cached == 0
    assert long_engine.slot_stats()["long_slots"] == 1

    # the agent's next call: its whole context so far, its output, a tool result; the long slot's buffer
    # comes back from the prefix cache (all but the last output token, whose KV was never computed)
    second = first + got.tokens + TOOL
    got2 = run(long_engine, {"a2": (second, GREEDY)})["a2"]
    ref2 = run(plain_engine, {"r2": (second, GREEDY)})["r2"]
    assert got2.tokens == ref2.tokens
    assert got2.logprobs == pytest.approx(ref2.logprobs, abs=1e-4)
    assert got2.cached == len(first) + len(got.tokens) - 1
    stats = long_engine.slot_stats()
    assert stats["long_slots"] == 1 and stats["long_prefix_copies"] == 0  # taken over, not copied


def test_row_that_fills_its_long_slot_finishes_with_length(model_dir: Path, plain_engine: Engine) -> None:
    e = make(model_dir, decode_slots="eager", slot_max_len=64, long_context_tokens=320, prefill_chunk=64)
    try:
        sp = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
        got = run(e, {"full": (SYSTEM, sp)})["full"]
    finally:
        e.shutdown()
    ref = run(plain_engine, {"ref": (SYSTEM, sp)})["ref"]
    assert got.finish == "length"
    # the slot's 320 columns hold the prompt and every output token's KV but the last one's
    assert len(got.tokens) == 320 - len(SYSTEM) + 1
    assert got.tokens == ref.tokens[: len(got.tokens)]


def test_short_request_decodes_while_a_long_prefill_runs(model_dir: Path, plain_engine: Engine) -> None:
    # chunks of 16 tokens and a prefill share of 0.2: the long prompt takes ~19 chunks with decode steps
    # of the short one between them; the short one, queued after the long one, is admitted at once
    e = make(
        model_dir,
        decode_slots="eager",
        slot_max_len=64,
        long_context_tokens=1024,
        prefill_chunk=16,
        prefill_share=0.2,
        run_steps=1,
    )
    order: list[str] = []
    short_sp = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    try:
        got = run(e, {"long": (SYSTEM, GREEDY), "short": (USER, short_sp)}, order)
    finally:
        e.shutdown()
    first_long = order.index("long")
    assert order[:first_long].count("short") == 16  # every token of the short one came first
    ref = run(plain_engine, {"rl": (SYSTEM, GREEDY), "rs": (USER, short_sp)})
    assert got["long"].tokens == ref["rl"].tokens
    assert got["short"].tokens == ref["rs"].tokens
    assert got["long"].logprobs == pytest.approx(ref["rl"].logprobs, abs=1e-4)


def test_releasing_kv_frees_the_long_slot_and_it_comes_back(model_dir: Path, plain_engine: Engine) -> None:
    e = make(model_dir, decode_slots="eager", slot_max_len=64, long_context_tokens=512, prefill_chunk=64)
    try:
        held = [e.slot_stats()["long_capacity"]]  # allocated at the first long call
        first = run(e, {"before": (SYSTEM, GREEDY)})["before"]
        held.append(e.slot_stats()["long_capacity"])
        e.call(e.release_memory, ["kv_cache"]).result(30)
        assert e.slot_stats()["long_slots"] == 1
        held.append(e.slot_stats()["long_capacity"])
        e.call(e.resume_memory, ["kv_cache"]).result(30)
        held.append(e.slot_stats()["long_capacity"])  # held again at resume, before any call
        again = run(e, {"after": (SYSTEM, GREEDY)})["after"]
    finally:
        e.shutdown()
    assert held == [0, 512, 0, 512]
    assert again.cached == 0  # the prefix cache and the slot's buffer were dropped
    assert again.tokens == first.tokens == run(plain_engine, {"ref": (SYSTEM, GREEDY)})["ref"].tokens


def test_a_resume_without_room_for_the_long_slots_says_so(
    model_dir: Path, plain_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The long slots' buffer is allocated at resume: a GPU without room for it (here an allocation that
    fails as CUDA's does) is an error naming the memory, the KV cache stays released, and a later resume
    with room serves as before."""
    e = make(model_dir, decode_slots="eager", slot_max_len=64, long_context_tokens=512, prefill_chunk=64)

    def no_room(self: SlotBatch) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 28.44 GiB.")

    try:
        run(e, {"first": (SYSTEM, GREEDY)})  # the long slots are in use, so a resume allocates them
        e.call(e.release_memory, ["kv_cache"]).result(30)
        with monkeypatch.context() as m:
            m.setattr(SlotBatch, "allocate", no_room)
            with pytest.raises(EngineUnavailable, match=r"resuming the KV cache needs [0-9.]+ GiB"):
                e.call(e.resume_memory, ["kv_cache"]).result(30)
        assert "kv_cache" in e.released and e.slot_stats()["long_capacity"] == 0
        e.call(e.resume_memory, ["kv_cache"]).result(30)
        out = run(e, {"after": (SYSTEM, GREEDY)})["after"]
    finally:
        e.shutdown()
    assert out.tokens == run(plain_engine, {"ref": (SYSTEM, GREEDY)})["ref"].tokens


def test_long_requests_wait_while_the_long_slots_find_no_room(
    model_dir: Path, plain_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The long slots' first allocation fails as CUDA's does when the GPU is full (another engine's prefix
    cache, a trainer): the prefix cache's entries go, the allocation is tried again, and while it keeps
    failing the long request waits and a short one runs on; once there is room the long one is served,
    equal to its reference. No request fails."""
    import gyre_engine.server.engine as engine_mod

    monkeypatch.setattr(engine_mod, "LONG_RETRY_S", 0.05)
    e = make(model_dir, decode_slots="eager", slot_max_len=64, long_context_tokens=512, prefill_chunk=64)
    real = SlotBatch.allocate
    tries: list[int] = []

    def full_gpu(self: SlotBatch) -> torch.Tensor:
        if self.dedicated and len(tries) < 6:
            tries.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 28.44 GiB.")
        return real(self)

    short = [1000 + i for i in range(20)]
    order: list[str] = []
    try:
        monkeypatch.setattr(SlotBatch, "allocate", full_gpu)
        outs = run(e, {"long": (SYSTEM, GREEDY), "short": (short, GREEDY)}, order, together=True)
        waited = e.stats().waiting_s
    finally:
        e.shutdown()
    assert len(tries) == 6  # two tries a round (before and after the cache's entries went), three rounds
    assert waited["long_memory"] > 0 and waited["long_slot"] == 0  # counted for what held it
    ref = run(plain_engine, {"long": (SYSTEM, GREEDY), "short": (short, GREEDY)})
    assert outs["long"].tokens == ref["long"].tokens and outs["short"].tokens == ref["short"].tokens
    assert order.index("short") < order.index("long")  # the short one did not wait for the room


OTHER = [1100 + (i * 17) % 600 for i in range(280)]
"""A second long context (no prefix shared with SYSTEM)."""


def test_long_calls_whose_rest_fits_start_together_beside_a_decoding_row(
    model_dir: Path, plain_engine: Engine
) -> None:
    """Two agents' next calls (each its cached long context plus a tool output that fits one prefill
    chunk) are prefilled at once into their long slots, in the same step, beside a long row that decodes:
    neither waits for the other through the chunked prefill, whose share of the time (0.05 here) would
    hold the second for many decode steps. Each equals its reference."""
    e = with_long_slots(model_dir, 3, prefill_chunk=256, prefill_share=0.05, run_steps=1)
    third = [1300 + (i * 7) % 500 for i in range(200)]
    busy_sp = SamplingParams(max_new_tokens=300, temperature=0.0, ignore_eos=True)
    order: list[str] = []
    try:
        first = run(e, {"a": (SYSTEM, GREEDY), "b": (OTHER, GREEDY)})
        calls = {
            "a2": (SYSTEM + first["a"].tokens + TOOL, GREEDY),
            "b2": (OTHER + first["b"].tokens + TOOL, GREEDY),
        }
        busy = submit(e, {"busy": (third, busy_sp)}, order)["busy"]
        until(lambda: len(busy.tokens) >= 5, "the long row decodes")
        got = run(e, calls, order, together=True)
        assert busy.done.wait(120)
        stats = e.slot_stats()
    finally:
        e.shutdown()
    start = {rid: order.index(rid) for rid in calls}
    between = order[min(start.values()) : max(start.values())]
    assert between.count("busy") <= 1, between  # started in one step, not one chunked prefill after another
    assert stats["long_prefills_at_once"] >= 2 and stats["long_prefix_copies"] == 0
    assert got["a2"].cached == len(SYSTEM) + len(first["a"].tokens) - 1  # each took its own slot back
    ref = run(plain_engine, calls)
    assert_as_served_alone(got, ref)


MIDDLE = [1600 + (i * 5) % 90 for i in range(44)]
"""A prompt that fits a decode slot but not one 32-token prefill pass: it needs the chunked prefill."""


def test_short_requests_pass_a_long_one_waiting_for_a_long_slot(
    model_dir: Path, plain_engine: Engine
) -> None:
    # one long slot, decoding "busy"; then "waiting" (long: no slot free), "chunked" (needs the chunked
    # prefill, which must not overtake "waiting") and "short" are queued in that order
    e = with_long_slots(model_dir, 1, prefill_chunk=32, run_steps=1)
    order: list[str] = []
    busy_sp = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    short_sp = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    calls = {
        "waiting": (OTHER, GREEDY),
        "chunked": (MIDDLE, short_sp),
        "short": (USER, short_sp),
    }
    try:
        busy = submit(e, {"busy": (SYSTEM, busy_sp)}, order)["busy"]
        while not busy.tokens:
            threading.Event().wait(0.01)
        got = run(e, calls, order, together=True)
        assert busy.done.wait(120)
        got["busy"] = busy
        waited = e.stats().waiting_s
    finally:
        e.shutdown()
    # what held them, in request-seconds of steps: "waiting" the busy slot, "chunked" the one before it
    assert waited["long_slot"] > 0 and waited["behind"] > 0 and waited["long_memory"] == 0
    first = {rid: order.index(rid) for rid in ("busy", *calls)}
    last = {rid: len(order) - 1 - order[::-1].index(rid) for rid in ("busy", *calls)}
    assert last["short"] < last["busy"] < first["waiting"]  # the short one ran while the long one waited
    assert first["waiting"] < first["chunked"]  # the chunked prefill went to the earlier request
    ref = run(plain_engine, {"busy": (SYSTEM, busy_sp), **calls})
    assert_as_served_alone(got, ref)


def test_short_request_passes_a_long_one_waiting_for_the_chunked_prefill(
    model_dir: Path, plain_engine: Engine
) -> None:
    # two long slots, but one chunked prefill at a time: "second" waits for "first"'s prefill to end;
    # "short", queued behind both, is admitted at once and done before "first" has its first token
    e = with_long_slots(model_dir, 2, prefill_chunk=16, run_steps=1)
    order: list[str] = []
    short_sp = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    calls = {"first": (SYSTEM, GREEDY), "second": (OTHER, GREEDY), "short": (USER, short_sp)}
    try:
        got = run(e, calls, order, together=True)
        waited = e.stats().waiting_s
    finally:
        e.shutdown()
    assert waited["chunked_prefill"] > 0 and waited["long_slot"] == 0
    assert order.count("short") == 8  # a token a step: one event each
    assert len(order) - 1 - order[::-1].index("short") < order.index("first") < order.index("second")
    ref = run(plain_engine, calls)
    assert_as_served_alone(got, ref)


THIRD = [1200 + (i * 19) % 500 for i in range(260)]
"""A third long context."""


def _snapshot(e: Engine, calls: dict[str, Call]) -> tuple[int, int, dict[str, int]]:
    """(decode steps, decode tokens, tokens per call) at one moment between two engine steps."""

    def take() -> tuple[int, int, dict[str, int]]:
        st = e.stats()
        return st.decode_steps, st.decode_tokens, {rid: len(c.tokens) for rid, c in calls.items()}

    return e.call(take).result(30)


@pytest.mark.parametrize("widths", ["bucketed", "full"])
def test_long_rows_decode_in_one_step_each_as_served_alone(
    model_dir: Path, plain_engine: Engine, widths: str
) -> None:
    e = with_long_slots(model_dir, 3, prefill_chunk=64, run_steps=1, slot_widths=widths)
    sp = SamplingParams(max_new_tokens=120, temperature=0.0, ignore_eos=True)
    calls = {"a": (SYSTEM, sp), "b": (OTHER, sp), "c": (THIRD, sp)}
    try:
        got = submit(e, calls, together=True)
        while min(_snapshot(e, got)[2].values()) < 1:  # until all three decode
            threading.Event().wait(0.01)
        steps0, toks0, n0 = _snapshot(e, got)
        while min(_snapshot(e, got)[2].values()) < max(n0.values()) + 10:
            threading.Event().wait(0.01)
        steps1, toks1, n1 = _snapshot(e, got)
        for c in got.values():
            assert c.done.wait(120)
        stats = e.slot_stats()
    finally:
        e.shutdown()
    assert all(0 < n < 120 for n in n1.values())  # all three decoded from the first snapshot to the second
    grown = {rid: n1[rid] - n0[rid] for rid in calls}
    assert len(set(grown.values())) == 1  # in step: one row each of the same lane steps
    assert steps1 - steps0 == grown["a"]  # one lane step per step for the three rows
    assert toks1 - toks0 == 3 * grown["a"]
    assert stats["long_slots"] == 3 and stats["long_rows"] == 0
    ref = run(plain_engine, calls)
    assert_as_served_alone(got, ref)


def test_a_follow_up_takes_over_its_slot_beside_a_running_row(model_dir: Path, plain_engine: Engine) -> None:
    # "a" (slot 0) ends early; "b" (slot 1) decodes on with slot 0 a hole held by the prefix cache; "a2",
    # extending "a", takes slot 0 back while "b" runs (prefilled there beside it, then decoding with it)
    e = with_long_slots(model_dir, 2, prefill_chunk=32, run_steps=4)
    short_sp = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    long_sp = SamplingParams(max_new_tokens=150, temperature=0.0, ignore_eos=True)
    try:
        got = submit(e, {"a": (SYSTEM, short_sp), "b": (OTHER, long_sp)}, together=True)
        assert got["a"].done.wait(120)
        second = SYSTEM + got["a"].tokens + TOOL
        kept = e.call(e.prefix.lookup, second, len(second)).result(30).kv
        a2 = run(e, {"a2": (second, GREEDY)})["a2"]
        b_running = not got["b"].done.is_set()
        assert got["b"].done.wait(120)
        after = e.call(e.prefix.lookup, second + a2.tokens, len(second) + len(a2.tokens)).result(30).kv
        stats = e.slot_stats()
    finally:
        e.shutdown()
    assert b_running  # "a2" ran beside "b"
    assert a2.cached == len(SYSTEM) + len(got["a"].tokens) - 1
    assert isinstance(kept, LongRowKV) and isinstance(after, LongRowKV)
    assert kept.buf is after.buf and kept.row == after.row == 0
    assert after.keys[0].data_ptr() == kept.keys[0].data_ptr()
    assert stats["long_prefix_copies"] == 0  # the cached context was taken over, not copied
    ref = run(plain_engine, {"a": (SYSTEM, short_sp), "b": (OTHER, long_sp), "a2": (second, GREEDY)})
    assert_as_served_alone({"a": got["a"], "b": got["b"], "a2": a2}, ref)


def test_a_long_call_whose_rest_fits_passes_one_waiting_for_the_chunked_prefill(
    model_dir: Path, plain_engine: Engine
) -> None:
    """Three long slots. "a" takes the chunked prefill, "b" and "d" wait for it (keeping one idle slot
    between them: they start one at a time), and "c", an agent's next call whose context is cached in its
    own idle slot and whose rest fits one chunk, starts at once in that slot: its first token comes before
    "a"'s, whose prefill takes many steps. (First come first served held "c" behind "b" until the chunked
    prefill was free.) Each equals its reference."""
    e = with_long_slots(model_dir, 3, prefill_chunk=32, run_steps=1)
    order: list[str] = []
    fourth = [1400 + (i * 3) % 500 for i in range(270)]
    try:
        first = run(e, {"c0": (THIRD, GREEDY)})["c0"]
        calls = {
            "a": (SYSTEM, GREEDY),
            "b": (OTHER, GREEDY),
            "d": (fourth, GREEDY),
            "c": (THIRD + first.tokens + TOOL[:16], GREEDY),
        }
        got = run(e, calls, order, together=True)
        waited = e.stats().waiting_s
    finally:
        e.shutdown()
    assert order.index("c") < order.index("a") < order.index("b") < order.index("d")
    assert got["c"].cached == len(THIRD) + len(first.tokens) - 1  # its own slot, taken back
    assert waited["chunked_prefill"] > 0
    assert_as_served_alone(got, run(plain_engine, calls))


def test_a_long_request_waits_for_a_free_long_slot(model_dir: Path, plain_engine: Engine) -> None:
    e = with_long_slots(model_dir, 2, prefill_chunk=64, run_steps=1)
    order: list[str] = []
    sp = SamplingParams(max_new_tokens=150, temperature=0.0, ignore_eos=True)
    calls = {"a": (SYSTEM, sp), "b": (OTHER, GREEDY), "c": (THIRD, GREEDY)}
    try:
        got = run(e, calls, order, together=True)
        stats = e.slot_stats()
    finally:
        e.shutdown()
    last_b = len(order) - 1 - order[::-1].index("b")
    assert order.index("b") < last_b < order.index("c")  # "c" had "b"'s slot once "b" finished
    assert order.index("c") < len(order) - 1 - order[::-1].index("a")  # while "a" still ran
    assert stats["long_slots"] == 2
    ref = run(plain_engine, calls)
    assert_as_served_alone(got, ref)


def test_a_waiting_request_is_looked_up_again_only_when_the_cache_changed(model_dir: Path) -> None:
    """One long slot decoding 60 tokens, a second long request waiting for it: the waiting one's context is
    compared with the cache's entries once while nothing comes into or leaves the cache (not at each of
    the 60 steps), and again once the first call's finish changed it."""
    e = with_long_slots(model_dir, 1, prefill_chunk=64, run_steps=1)
    sizes: list[int] = []
    lookup = e.prefix.lookup

    def counted(tokens: Any, limit: int) -> Any:
        sizes.append(len(tokens))
        return lookup(tokens, limit)

    e.prefix.lookup = counted  # type: ignore[method-assign]
    busy_sp = SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)
    try:
        got = run(e, {"busy": (SYSTEM, busy_sp), "waiting": (OTHER, GREEDY)}, together=True)
        st = e.call(e.stats).result(30)
    finally:
        e.shutdown()
    assert len(got["busy"].tokens) == 60 and len(got["waiting"].tokens) == GREEDY.max_new_tokens
    # the thread's time: decode and prefill are parts of its steps; `run(together=True)` held it in a call
    assert st.step_time_s >= st.decode_time_s + st.prefill_time_s > 0 and st.command_time_s > 0
    assert 1 <= sizes.count(len(OTHER)) <= 3, sizes  # at the first step, after the finish (and a spare)


def test_a_long_rows_kv_exports_from_its_slot(model_dir: Path, hf_model: Any) -> None:
    """The prefix export (/export_prefix, /offer_prefix read the same cached KV) of a context whose KV
    sits in the second long slot: that slot's columns, equal to the model's own KV of the context."""
    from gyre_engine.server.kv_transfer import export_prefix

    e = with_long_slots(model_dir, 2)
    sp = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    try:
        got = run(e, {"a": (SYSTEM, sp), "b": (OTHER, sp)}, together=True)
        ctx = OTHER + got["b"].tokens[:-1]
        kv = e.call(e.prefix.lookup, ctx, len(ctx)).result(30).kv
        rec = e.call(export_prefix, e, ctx).result(30)
    finally:
        e.shutdown()
    assert isinstance(kv, LongRowKV) and kv.row == 1
    assert rec is not None and rec.token_ids == ctx
    with torch.inference_mode():
        ref = hf_model(input_ids=torch.tensor([ctx]), use_cache=True).past_key_values
    heads, n, dim = rec.shape
    for layer, (kb, vb) in enumerate(zip(rec.keys, rec.values, strict=True)):
        k = torch.frombuffer(bytearray(kb), dtype=getattr(torch, rec.dtype)).reshape(heads, n, dim)
        v = torch.frombuffer(bytearray(vb), dtype=getattr(torch, rec.dtype)).reshape(heads, n, dim)
        assert torch.allclose(k, ref.layers[layer].keys[0], atol=1e-4)
        assert torch.allclose(v, ref.layers[layer].values[0], atol=1e-4)


def test_a_new_long_context_takes_the_slot_used_least_recently(model_dir: Path, plain_engine: Engine) -> None:
    """Both long slots hold a cached context when a new one comes: it takes the slot whose context was
    used least recently ("b"'s), so the agent that came back since ("a", whose next call took its slot
    over) keeps its context, and its next call takes the slot over again with no copy."""
    e = with_long_slots(model_dir, 2, prefill_chunk=64, run_steps=1)
    try:
        a = run(e, {"a": (SYSTEM, GREEDY)})["a"]
        run(e, {"b": (OTHER, GREEDY)})
        second = SYSTEM + a.tokens + TOOL
        a2 = run(e, {"a2": (second, GREEDY)})["a2"]
        run(e, {"c": (THIRD, GREEDY)})
        third = second + a2.tokens + USER
        a3 = run(e, {"a3": (third, GREEDY)})["a3"]
        c_ctx = [*THIRD, 0]
        c_kv = e.call(e.prefix.lookup, c_ctx, len(c_ctx)).result(30).kv
        b_hit = e.call(e.prefix.lookup, [*OTHER, 0], len(OTHER)).result(30).length
        stats = e.slot_stats()
    finally:
        e.shutdown()
    assert isinstance(c_kv, LongRowKV) and c_kv.row == 1  # "b"'s slot, used least recently
    assert b_hit == 0  # "b"'s context went with its slot
    assert a3.cached == len(second) + len(a2.tokens) - 1  # "a"'s context stayed in slot 0
    assert stats["long_prefix_copies"] == 0
    ref = run(plain_engine, {"a3": (third, GREEDY)})["a3"]
    assert a3.tokens == ref.tokens


@pytest.mark.parametrize("host_tokens", [0, 4096])
def test_a_context_whose_long_slot_is_taken_comes_back_from_the_host_tier(
    model_dir: Path, plain_engine: Engine, host_tokens: int
) -> None:
    """One long slot, two agents: "b" takes the slot holding "a"'s context. With a host tier that
    context is copied to host memory first, and "a"'s next call gets it back from there (copied into
    the slot, not computed again: its cached tokens are the whole earlier context); without one it is
    computed again. The tokens are the same either way."""
    e = with_long_slots(model_dir, 1, prefill_chunk=64, run_steps=1, host_cached_tokens=host_tokens)
    try:
        a = run(e, {"a": (SYSTEM, GREEDY)})["a"]
        run(e, {"b": (OTHER, GREEDY)})
        second = SYSTEM + a.tokens + TOOL
        a2 = run(e, {"a2": (second, GREEDY)})["a2"]
        st = e.stats()
    finally:
        e.shutdown()
    earlier = len(SYSTEM) + len(a.tokens) - 1
    if host_tokens:
        assert a2.cached == earlier
        assert st.host_hit_tokens == earlier and st.host_spilled_tokens >= earlier  # one hit, counted once
        assert st.host_cached_tokens > 0  # "b"'s context went there in turn
    else:
        assert a2.cached < len(SYSTEM)  # at most what the slot's new context shares with it
        assert (st.host_hit_tokens, st.host_spilled_tokens, st.host_cached_tokens) == (0, 0, 0)
    assert_as_served_alone({"a2": a2}, run(plain_engine, {"a2": (second, GREEDY)}))


@pytest.mark.parametrize("slots, host_tokens", [(2, 0), (1, 4096)])
def test_a_call_sharing_only_a_groups_prompt_leaves_the_slot_to_its_context(
    model_dir: Path, plain_engine: Engine, slots: int, host_tokens: int
) -> None:
    """Two executions of a group share a prompt longer than a decode slot. "b"'s first call finds that
    prompt in the long slot holding "a"'s context, and its hit is only the prompt: it takes another slot
    (the prompt copied there), or, with the one slot, the same after "a"'s context went to the host
    tier. Either way "a"'s next call finds its whole context, and every call's tokens are those served
    alone."""
    prompt = SYSTEM[:200]
    e = with_long_slots(model_dir, slots, prefill_chunk=64, run_steps=1, host_cached_tokens=host_tokens)
    try:
        a = run(e, {"a": (prompt + USER, GREEDY)})["a"]
        b = run(e, {"b": (prompt + TOOL, GREEDY)})["b"]
        second = prompt + USER + a.tokens + TOOL[:40]
        a2 = run(e, {"a2": (second, GREEDY)})["a2"]
        stats, st = e.slot_stats(), e.stats()
    finally:
        e.shutdown()
    assert b.cached == len(prompt)
    assert a2.cached == len(prompt) + len(USER) + len(a.tokens) - 1  # "a"'s whole context
    if host_tokens:
        assert st.host_hit_tokens == a2.cached  # it came back from the host tier
    else:
        assert stats["long_prefix_copies"] == 1  # the prompt, into "b"'s slot
        assert st.host_hit_tokens == 0
    ref = run(plain_engine, {"b": (prompt + TOOL, GREEDY), "a2": (second, GREEDY)})
    assert_as_served_alone({"b": b, "a2": a2}, ref)
