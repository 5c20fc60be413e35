"""`min_free_bytes`: an engine whose GPU runs short of free memory drops least-recently-used prefix-cache
entries before its next step, and serves every request exactly as before.

The GPU's free memory is the one thing not real here (the tests run on the CPU): `device_free_bytes`
reports a device whose memory the cached tokens take, as `torch.cuda.mem_get_info` would."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from gyre_engine.protocol import SamplingParams

torch = pytest.importorskip("torch")
from gyre_engine.server.engine import Engine  # noqa: E402
from gyre_engine.server.request import EngineRequest, TokenEvent  # noqa: E402
from gyre_engine.server.slots import SlotBatch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

GIB = 1 << 30
A = [1300 + i * 5 for i in range(40)]
B = [1700 + i * 3 for i in range(24)]


class SharedGpu(Engine):
    """An engine on a device of `capacity` bytes, of which its cached prefixes take their KV's bytes and
    `others` bytes are held by other processes."""

    capacity = 8 * GIB
    others = 0

    def device_free_bytes(self) -> int | None:
        return self.capacity - self.others - self.prefix.total_tokens * kv_bytes(self)


def kv_bytes(e: Engine) -> int:
    return SlotBatch.token_bytes(e.model)


@pytest.fixture
def engine(model_dir: Path) -> Iterator[SharedGpu]:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    e = SharedGpu(model, AutoTokenizer.from_pretrained(str(model_dir)), Engine.Config(min_free_bytes=GIB))
    e.start()
    yield e
    e.shutdown()


def run(e: Engine, rid: str, prompt: list[int], n: int = 6) -> list[int]:
    out: list[int] = []
    done = threading.Event()

    def sink(ev: TokenEvent) -> None:
        out.extend(ev.token_ids)
        if ev.finish is not None:
            done.set()

    sp = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    e.submit(EngineRequest(rid, prompt, sp), sink).result(30)
    assert done.wait(60)
    return out


def test_with_room_nothing_is_evicted_and_the_next_call_hits_the_cache(
    engine: SharedGpu, greedy: Callable[[list[int], int], list[int]]
) -> None:
    first = run(engine, "a1", A)
    cached = engine.stats().prefill_tokens_cached
    second = run(engine, "a2", A + first + [1250])
    assert engine.stats().memory_evicted_tokens == 0
    assert engine.stats().prefill_tokens_cached - cached >= len(A)
    assert first == greedy(A, 6) and second == greedy(A + first + [1250], 6)


def test_short_of_memory_the_least_recently_used_prefix_goes_first(
    engine: SharedGpu, greedy: Callable[[list[int], int], list[int]]
) -> None:
    run(engine, "a", A)
    run(engine, "b", B)  # B's context is now the most recently used entry
    per_token = kv_bytes(engine)
    held = engine.prefix.total_tokens
    assert held >= len(A) + len(B)
    # other processes now hold so much that the GPU has half of A's KV less free than the 1 GiB kept
    engine.others = engine.capacity - held * per_token - GIB + len(A) * per_token // 2
    out = run(engine, "c", [1900, 1901, 1902])
    evicted = engine.stats().memory_evicted_tokens
    assert len(A) <= evicted < held  # one entry (A's context) was enough
    assert engine.prefix.lookup([*A, 1], len(A)).length == 0  # A's context went ...
    assert engine.prefix.lookup([*B, 1], len(B)).length == len(B)  # ... the more recent B's stayed
    assert out == greedy([1900, 1901, 1902], 6)


def test_with_nothing_cached_to_drop_the_step_still_runs(
    engine: SharedGpu, greedy: Callable[[list[int], int], list[int]]
) -> None:
    engine.others = engine.capacity  # nothing free at all, and nothing cached to drop
    assert run(engine, "x", A) == greedy(A, 6)
    assert engine.stats().memory_evicted_tokens == 0
    assert engine.prefix.total_tokens >= len(A)  # its context cached when it finished
