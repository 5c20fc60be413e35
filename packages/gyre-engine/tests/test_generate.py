"""/generate against a real server subprocess with the tiny model: exactness, logprobs, prefix reuse,
concurrency, streaming and bad input."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from gyre_engine.client import EngineClient, EngineError
from gyre_engine.protocol import SamplingParams

torch = pytest.importorskip("torch")

Greedy = Callable[[list[int], int], list[int]]

# token ids by role band, so a failure reads as names
SYSTEM = [1000 + i for i in range(12)]
USER = [1200 + i * 7 for i in range(9)]
TOOL = [1400 + i * 3 for i in range(15)]
GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _gen(url: str, ids: list[int], sp: SamplingParams = GREEDY, **kw: Any) -> Any:
    async with EngineClient(url, timeout_s=60) as c:
        return await c.generate(ids, sp, **kw)


def test_greedy_equals_transformers_generate(server: Any, greedy: Greedy) -> None:
    ids = SYSTEM + USER
    r = run(_gen(server.url, ids))
    assert r.output_ids == greedy(ids, 24)
    assert r.meta_info.finish_reason is not None and r.meta_info.finish_reason.type == "length"
    assert (r.meta_info.prompt_tokens, r.meta_info.completion_tokens) == (len(ids), 24)


def test_logprobs_equal_a_separate_forward_pass(server: Any, hf_model: Any) -> None:
    ids = SYSTEM + TOOL
    sp = SamplingParams(max_new_tokens=16, temperature=0.7, sampling_seed=7, ignore_eos=True)
    r = run(_gen(server.url, ids, sp, return_logprob=True))
    lps = r.meta_info.output_token_logprobs
    assert lps is not None and [e[1] for e in lps] == r.output_ids
    full = torch.tensor([ids + r.output_ids])
    with torch.no_grad():
        logits = hf_model(full).logits[0, len(ids) - 1 : -1]
    expected = (
        torch.log_softmax(logits / 0.7, dim=-1).gather(-1, torch.tensor(r.output_ids)[:, None]).squeeze(-1)
    )
    assert torch.allclose(torch.tensor([e[0] for e in lps]), expected, atol=1e-4)


def test_seeded_sampling_is_reproducible(server: Any) -> None:
    sp = SamplingParams(
        max_new_tokens=12, temperature=1.0, top_p=0.9, top_k=50, sampling_seed=123, ignore_eos=True
    )
    a, b = run(_gen(server.url, USER, sp)), run(_gen(server.url, USER, sp))
    assert a.output_ids == b.output_ids


def test_prefix_reuse_gives_identical_outputs_with_fewer_computed_tokens(server: Any, greedy: Greedy) -> None:
    async def go() -> None:
        async with EngineClient(server.url) as c:
            await c.flush_cache()
            first_ids = SYSTEM + USER + TOOL
            first = await c.generate(first_ids, GREEDY)
            assert first.meta_info.cached_tokens == 0
            before = await c.server_info()
            # an agent's next call: the whole previous context, the model's answer, then a tool result
            second_ids = first_ids + first.output_ids + TOOL[:5]
            second = await c.generate(second_ids, GREEDY)
            after = await c.server_info()
            assert second.meta_info.cached_tokens == len(first_ids) + len(first.output_ids) - 1
            computed = after.prefill_tokens_computed - before.prefill_tokens_computed
            assert computed == len(second_ids) - second.meta_info.cached_tokens
            assert second.output_ids == greedy(second_ids, 24)

    run(go())


def test_concurrent_requests_do_not_interfere(server: Any, greedy: Greedy) -> None:
    prompts = [SYSTEM[: 3 + i] + USER[i % 5 :] + TOOL[: i * 2] for i in range(8)]

    async def go() -> list[Any]:
        async with EngineClient(server.url) as c:
            await c.flush_cache()
            return list(await asyncio.gather(*(c.generate(p, GREEDY) for p in prompts)))

    results = run(go())
    for p, r in zip(prompts, results, strict=True):
        assert r.output_ids == greedy(p, 24)


def test_short_and_long_contexts_run_together_in_separate_lanes(server: Any, greedy: Greedy) -> None:
    long_ctx = (SYSTEM + USER + TOOL) * 8  # ~290 tokens: its own lane, next to the short ones
    prompts = [USER, long_ctx, TOOL, long_ctx[:150]]

    async def go() -> list[Any]:
        async with EngineClient(server.url) as c:
            await c.flush_cache()
            return list(await asyncio.gather(*(c.generate(p, GREEDY) for p in prompts)))

    for p, r in zip(prompts, run(go()), strict=True):
        assert r.output_ids == greedy(p, 24)


def test_batch_form_of_generate(server: Any, greedy: Greedy) -> None:
    async def go() -> list[Any]:
        async with EngineClient(server.url) as c:
            return await c.generate_batch([USER, TOOL], GREEDY)

    a, b = run(go())
    assert a.output_ids == greedy(USER, 24)
    assert b.output_ids == greedy(TOOL, 24)


def test_streaming_is_cumulative_and_ends_like_the_plain_call(server: Any) -> None:
    async def go() -> tuple[list[Any], Any]:
        async with EngineClient(server.url) as c:
            chunks = [ch async for ch in c.stream(SYSTEM, GREEDY, return_logprob=True)]
            return chunks, await c.generate(SYSTEM, GREEDY)

    chunks, plain = run(go())
    assert len(chunks) == 24
    for i, ch in enumerate(chunks):
        assert ch.output_ids == plain.output_ids[: i + 1]
        assert (ch.meta_info.finish_reason is None) == (i < 23)
    assert chunks[-1].text == plain.text
    with httpx.stream(
        "POST", f"{server.url}/generate", json={"input_ids": USER, "stream": True}, timeout=30
    ) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"


def test_stop_token_and_stop_string(server: Any, tokenizer: Any) -> None:
    free = run(_gen(server.url, USER))
    stop_id = free.output_ids[5]
    r = run(
        _gen(server.url, USER, SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=[stop_id]))
    )
    assert r.output_ids == free.output_ids[: free.output_ids.index(stop_id) + 1]
    assert r.meta_info.finish_reason is not None and r.meta_info.finish_reason.matched == stop_id
    piece = tokenizer.decode([free.output_ids[3]])
    if piece.strip():
        r = run(_gen(server.url, USER, SamplingParams(max_new_tokens=24, temperature=0.0, stop=[piece])))
        assert r.meta_info.finish_reason is not None and r.meta_info.finish_reason.matched == piece
        assert piece not in r.text
        sp = SamplingParams(max_new_tokens=24, temperature=0.0, stop_regex=re.escape(piece))
        r = run(_gen(server.url, USER, sp))
        assert r.meta_info.finish_reason is not None and r.meta_info.finish_reason.matched == piece


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"input_ids": [1, 2], "sampling_params": {"bogus_key": 1}}, "unknown field `bogus_key`"),
        ({"input_ids": [1, 99999]}, "outside the vocabulary"),
        ({"input_ids": []}, "empty"),
        ({"input_ids": [1] * 40961}, "context length"),
        ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),
        ({"input_ids": [1], "sampling_params": {"regex": "a+"}}, "not supported"),
        ({"input_ids": [1], "sampling_params": {"stop_regex": "("}}, "stop_regex"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": "x"}}, "Expected `int"),
        ({"sampling_params": {}}, "input_ids"),
    ],
)
def test_bad_input_is_a_400_and_the_server_keeps_serving(
    server: Any, body: dict[str, Any], needle: str
) -> None:
    r = httpx.post(f"{server.url}/generate", json=body, timeout=30)
    assert r.status_code == 400
    assert needle in r.json()["error"]["message"]
    ok = run(_gen(server.url, USER, SamplingParams(max_new_tokens=2)))
    assert ok.meta_info.completion_tokens == 2


def test_client_raises_engine_error_with_the_message(server: Any) -> None:
    with pytest.raises(EngineError, match="outside the vocabulary") as info:
        run(_gen(server.url, [5, 1 << 20]))
    assert info.value.status == 400 and not info.value.retryable


def test_top_logprobs_text_and_zero_new_tokens(server: Any) -> None:
    body = {
        "input_ids": USER,
        "sampling_params": {"max_new_tokens": 3, "temperature": 0.0},
        "return_logprob": True,
        "top_logprobs_num": 4,
        "return_text_in_logprobs": True,
    }
    meta = httpx.post(f"{server.url}/generate", json=body, timeout=30).json()["meta_info"]
    assert len(meta["output_top_logprobs"]) == 3
    for (lp, tid, text), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True):
        assert isinstance(text, str) and len(top) == 4
        assert top[0][1] == tid and top[0][0] == pytest.approx(lp)  # greedy picks the top entry
    r = run(_gen(server.url, USER, SamplingParams(max_new_tokens=0)))
    assert r.output_ids == [] and r.meta_info.finish_reason.type == "length"


async def _wait_idle(c: EngineClient) -> None:
    for _ in range(200):
        if (await c.server_info()).running_requests == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("requests still running after 10 s")


def test_duplicate_rid_is_refused_and_a_dropped_stream_frees_its_row(server: Any) -> None:
    long = SamplingParams(max_new_tokens=20000, temperature=0.0, ignore_eos=True)

    async def go() -> None:
        async with EngineClient(server.url, timeout_s=60) as c:
            task = asyncio.create_task(c.generate(USER, long, rid="dup"))
            while (await c.server_info()).running_requests == 0:
                await asyncio.sleep(0.02)
            with pytest.raises(EngineError, match="already running"):
                await c.generate(USER, GREEDY, rid="dup")
            await c.abort("dup")
            assert (await task).meta_info.finish_reason.type == "abort"
            async with httpx.AsyncClient(timeout=30) as h:
                body = {"input_ids": USER, "sampling_params": msgspec_builtins(long), "stream": True}
                async with h.stream("POST", f"{server.url}/generate", json=body) as resp:
                    async for line in resp.aiter_lines():
                        if line.startswith("data:"):
                            break  # the client goes away mid-stream
            await _wait_idle(c)

    run(go())


def msgspec_builtins(sp: SamplingParams) -> Any:
    import msgspec

    return msgspec.to_builtins(sp)
