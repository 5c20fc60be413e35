"""End to end with the embedded tiny model: a real gyre-engine server subprocess (real sampling on the
CPU) behind the proxy, driven by the official SDKs. The content is nonsense; the protocol and the
records are exact: outputs as sampled, later inputs extend earlier input + output unchanged."""

from __future__ import annotations

import threading
import time
from typing import Any
from urllib.parse import quote

import anthropic
import httpx
import numpy as np
import openai
import pytest
from gyre_traj.io import read_records
from gyre_traj.records import Call

from .conftest import EngineProc, TinyEngines

pytestmark = pytest.mark.slow


def _full(recs: list[Call]) -> list[np.ndarray]:
    seq: dict[str, np.ndarray] = {}
    out = []
    for r in recs:
        if r.input_ids is not None:
            inp = r.input_ids
        else:
            assert r.input_delta is not None
            inp = np.concatenate([seq[r.input_delta.parent][: r.input_delta.keep], r.input_delta.append])
        seq[r.call_id] = np.concatenate([inp, r.output_ids])
        out.append(inp)
    return out


def test_tiny_model_behind_the_proxy(tiny_engines: TinyEngines, make_proxy: Any, request: Any) -> None:
    urls, model = tiny_engines.urls, tiny_engines.model
    ps = make_proxy(urls[:1], tokenizer=str(model))
    client = anthropic.Anthropic(base_url=ps.url, api_key="k", max_retries=0)
    request.addfinalizer(client.close)
    msgs: list[Any] = [{"role": "user", "content": "Write a function."}]
    r1 = client.messages.create(model="tiny", max_tokens=12, messages=msgs)
    assert r1.usage.output_tokens >= 1
    msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r1.content] or "x"}]
    msgs += [{"role": "user", "content": "Again."}]
    with client.messages.stream(model="tiny", max_tokens=12, messages=msgs) as st:
        list(st)
        r2 = st.get_final_message()
    assert r2.usage.output_tokens >= 1
    oa = openai.OpenAI(base_url=f"{ps.url}/v1", api_key="k", max_retries=0)
    request.addfinalizer(oa.close)
    r3 = oa.chat.completions.create(model="tiny", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert r3.usage is not None and r3.usage.completion_tokens >= 1

    recs = [r for r in read_records(ps.log_path) if isinstance(r, Call)]
    assert len(recs) == 3
    inputs = _full(recs)
    for r in recs:
        assert 1 <= r.output_ids.size <= 12 and np.all(r.output_logprobs <= 0)
    first = np.concatenate([inputs[0], recs[0].output_ids]).tolist()
    if r1.content:  # the second call carries the first call's sampled ids unchanged
        assert inputs[1].tolist()[: len(first)] == first
    assert recs[0].output_ids.size == r1.usage.output_tokens


@pytest.mark.parametrize("kv_transport", ["shm", "cuda_ipc"])
def test_drain_moves_the_cached_prefix_between_gyre_engines(
    tiny_engines: TinyEngines, make_proxy: Any, sched_stub: Any, request: Any, kv_transport: str
) -> None:
    """A call drained off engine 0 mid-generation continues on engine 1: its prompt's KV is exported from
    engine 0 and imported into engine 1 (counted), the tokens already sampled are kept, and the harness
    gets one response of the full length. With "cuda_ipc" the proxy asks for a device-to-device offer,
    which engines on the CPU make over shared memory: the KV still moves."""
    from gyre_sched.protocol import EngineAdd, EngineDrain, EngineDrained, Hello, Welcome

    urls, model = tiny_engines.urls, tiny_engines.model
    ps = make_proxy([], tokenizer=str(model), sched=sched_stub.endpoint, kv_transport=kv_transport)
    sched_stub.expect(Hello)
    sched_stub.send(Welcome())
    sched_stub.send(EngineAdd(0, urls[0]))
    deadline = time.monotonic() + 10
    while not ps.proxy.pool or not ps.proxy.pool.engines:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    client = anthropic.Anthropic(base_url=ps.url, api_key="k", max_retries=0)
    request.addfinalizer(client.close)
    # gyre-engine caches a prompt's KV when a request on it finishes (not when one is aborted): a first,
    # one-token call leaves this prompt in engine 0's prefix cache, so the drained call can take it along
    warm = client.messages.create(model="tiny", max_tokens=1, messages=[{"role": "user", "content": "count"}])
    assert warm.usage.output_tokens == 1
    n_out = 1500
    with client.messages.stream(
        model="tiny",
        max_tokens=n_out,
        messages=[{"role": "user", "content": "count"}],
        extra_body={"temperature": 0.0},
    ) as st:
        for ev in st:
            if ev.type == "content_block_delta":  # tokens are flowing from engine 0: drain it
                sched_stub.send(EngineAdd(1, urls[1]))
                sched_stub.send(EngineDrain(0))
                break
        for _ in st:
            pass
        final = st.get_final_message()
    assert sched_stub.expect(EngineDrained).cell_id == 0
    assert final.usage.output_tokens == n_out and final.stop_reason == "max_tokens"
    rec = [r for r in read_records(ps.log_path) if isinstance(r, Call)][-1]
    assert rec.output_ids.size == n_out and rec.output_logprobs.size == n_out
    assert np.all(rec.output_logprobs <= 0)
    stats = httpx.get(f"{ps.url}/gyre/stats").json()
    assert stats["moved_calls"] == 1
    assert stats["prefix_moved_calls"] == 1  # this call's KV moved (kv_migrations in gyre run's metrics)
    d = rec.input_delta
    n_in = d.keep + d.append.size if d is not None else rec.input_ids.size  # type: ignore[union-attr]
    assert (
        stats["prefix_moved_tokens"] >= n_in - 1
    )  # the prompt's KV went along (its last token is recomputed)
    assert stats["prefix_moved_tokens"] + stats["reprefilled_tokens"] > n_in  # + the partial output


def test_a_call_that_continues_on_the_engine_it_left_moves_no_prefix(
    tiny_engines: TinyEngines, make_proxy: Any, request: Any
) -> None:
    """A call its only engine aborts mid-generation (an engine error ends every running request this way)
    continues on that same engine: the prefix taken out for the move is not installed back into the
    engine it came from (its prefix cache still holds it; over CUDA IPC an engine cannot open its own
    offer), nothing counts as moved or prefilled again, and the offer is released."""
    url, model = tiny_engines.urls[0], tiny_engines.model
    ps = make_proxy([url], tokenizer=str(model), kv_transport="shm")
    client = anthropic.Anthropic(base_url=ps.url, api_key="k", max_retries=0)
    request.addfinalizer(client.close)
    msgs: list[Any] = [{"role": "user", "content": "count"}]
    assert client.messages.create(model="tiny", max_tokens=1, messages=msgs).usage.output_tokens == 1
    n_out = 1500
    with client.messages.stream(
        model="tiny", max_tokens=n_out, messages=msgs, extra_body={"temperature": 0.0}
    ) as st:
        for ev in st:
            if ev.type == "content_block_delta":
                httpx.post(f"{url}/abort_request", json={"abort_all": True}).raise_for_status()
                break
        for _ in st:
            pass
        final = st.get_final_message()
    assert final.usage.output_tokens == n_out
    stats = httpx.get(f"{ps.url}/gyre/stats").json()
    assert stats["moved_calls"] == 1
    assert (stats["prefix_moved_calls"], stats["prefix_moved_tokens"], stats["reprefilled_tokens"]) == (
        0,
        0,
        0,
    )
    assert httpx.get(f"{url}/server_info").json()["open_prefix_offers"] == 0


def test_a_drained_call_exports_its_kv_before_the_drain_is_confirmed(
    tiny_engines: TinyEngines, make_proxy: Any, sched_stub: Any, request: Any
) -> None:
    """As in `gyre run`: the moment the proxy confirms the drain, the scheduler removes the engine and the
    cell releases its memory (clearing its prefix cache). The moved call's KV must already be out by then:
    the export happens while the call still counts as in flight on the draining engine, so the drain
    waits for it (seen on the H200: exported after the confirmation, every move re-prefilled)."""
    from gyre_sched.protocol import EngineAdd, EngineDrain, EngineDrained, EngineRemove, Hello, Welcome

    urls, model = tiny_engines.urls, tiny_engines.model
    ps = make_proxy([], tokenizer=str(model), sched=sched_stub.endpoint)
    sched_stub.expect(Hello)
    sched_stub.send(Welcome())
    sched_stub.send(EngineAdd(0, urls[0]))
    deadline = time.monotonic() + 10
    while not ps.proxy.pool or not ps.proxy.pool.engines:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    client = anthropic.Anthropic(base_url=ps.url, api_key="k", max_retries=0)
    request.addfinalizer(client.close)
    warm = client.messages.create(model="tiny", max_tokens=1, messages=[{"role": "user", "content": "tally"}])
    assert warm.usage.output_tokens == 1
    released: list[float] = []

    def scheduler_and_cell() -> None:  # what gyre-sched and `gyre cell` do on EngineDrained, at once
        sched_stub.expect(EngineDrained, timeout_s=60)
        sched_stub.send(EngineRemove(0))
        end = time.monotonic() + 30
        while time.monotonic() < end:  # 409 until the engine is idle, as the cell retries
            r = httpx.post(f"{urls[0]}/release_memory_occupation", json={"tags": ["kv_cache"]}, timeout=30)
            if r.status_code != 409:
                r.raise_for_status()
                released.append(time.monotonic())
                return
            time.sleep(0.01)

    worker = threading.Thread(target=scheduler_and_cell)
    with client.messages.stream(
        model="tiny",
        max_tokens=1500,
        messages=[{"role": "user", "content": "tally"}],
        extra_body={"temperature": 0.0},
    ) as st:
        for ev in st:
            if ev.type == "content_block_delta":
                sched_stub.send(EngineAdd(1, urls[1]))
                sched_stub.send(EngineDrain(0))
                worker.start()
                break
        for _ in st:
            pass
        final = st.get_final_message()
    worker.join(60)
    try:
        assert released, "the cell never released engine 0"
        assert final.usage.output_tokens == 1500
        stats = httpx.get(f"{ps.url}/gyre/stats").json()
        assert stats["moved_calls"] == 1
        assert stats["prefix_moved_calls"] == 1  # exported before the release cleared engine 0's cache
    finally:
        httpx.post(f"{urls[0]}/resume_memory_occupation", json={"tags": ["kv_cache"]}, timeout=30)


def _tally(ps: Any, execution: str, request: Any) -> tuple[int, Call]:
    """One greedy Anthropic call of `execution` through the proxy `ps`: the proxy's engine errors so far and
    the call's record, which holds what the client got."""
    client = anthropic.Anthropic(base_url=ps.url, api_key="k", max_retries=0)
    request.addfinalizer(client.close)
    out = client.messages.create(
        model="tiny",
        max_tokens=8,
        messages=[{"role": "user", "content": "tally"}],
        extra_headers={"x-gyre-execution": execution},
        extra_body={"temperature": 0.0},
    )
    assert out.usage.output_tokens >= 1
    stats = httpx.get(f"{ps.url}/gyre/stats", timeout=10).json()
    rec = [c for c in read_records(ps.log_path) if isinstance(c, Call)][-1]
    assert rec.execution_id == execution and rec.output_ids.size == out.usage.output_tokens
    return int(stats["engine_errors"]), rec


def test_a_call_routed_to_an_engine_that_just_released_its_memory_goes_on_elsewhere(
    tiny_engines: TinyEngines, make_proxy: Any, request: Any
) -> None:
    """In `gyre run` a call can be routed to an engine in the moment before its drain: the cell then
    releases the engine's memory and the call's request meets a 409 `EngineUnavailable`, marked
    retryable (seen on a GPU run, where the harness got a 400 and its execution failed). The call goes
    on on the other engine, and its record is whole."""
    urls, model = tiny_engines.urls, tiny_engines.model
    r = httpx.post(f"{urls[0]}/release_memory_occupation", json={"tags": ["kv_cache"]}, timeout=30)
    r.raise_for_status()
    request.addfinalizer(
        lambda: httpx.post(f"{urls[0]}/resume_memory_occupation", json={"tags": ["kv_cache"]}, timeout=30)
    )
    refused = httpx.post(f"{urls[0]}/generate", json={"input_ids": [1, 2], "sampling_params": {}}, timeout=30)
    err = refused.json()["error"]
    assert (refused.status_code, err["type"], err["retryable"]) == (409, "EngineUnavailable", True)
    ps = make_proxy(urls, tokenizer=str(model))
    assert ps.proxy.pool is not None
    ps.proxy.pool.affinity["released-1"] = 0  # the proxy still takes engine 0 for a live one
    errors, rec = _tally(ps, "released-1", request)
    assert errors == 1
    assert rec.output_logprobs.size == rec.output_ids.size


def test_a_call_to_a_lone_engine_with_its_memory_released_waits_for_it(
    tiny_engines: TinyEngines, make_proxy: Any, request: Any
) -> None:
    """With one engine and its memory released (the moment between a cell's release and the proxy's
    drain), the call's attempts back off instead of spending themselves on 409s in milliseconds: the
    memory comes back a second later and the call completes (it got a 529 before)."""
    urls, model = tiny_engines.urls, tiny_engines.model
    httpx.post(
        f"{urls[0]}/release_memory_occupation", json={"tags": ["kv_cache"]}, timeout=30
    ).raise_for_status()
    resumed = threading.Timer(
        1.0,
        lambda: httpx.post(f"{urls[0]}/resume_memory_occupation", json={"tags": ["kv_cache"]}, timeout=30),
    )
    request.addfinalizer(
        lambda: (
            resumed.cancel(),
            httpx.post(f"{urls[0]}/resume_memory_occupation", json={"tags": ["kv_cache"]}, timeout=30),
        )
    )
    ps = make_proxy(urls[:1], tokenizer=str(model))
    resumed.start()
    errors, _ = _tally(ps, "lone-1", request)
    assert 1 <= errors < 8


def test_top_logprobs_from_a_real_engine(tiny_engines: TinyEngines, make_proxy: Any, request: Any) -> None:
    """OpenAI `top_logprobs` asks gyre-engine for `top_logprobs_num`: each sampled token comes with that
    many alternatives, its own logprob among them when it is one of the most likely."""
    ps = make_proxy(tiny_engines.urls[:1], tokenizer=str(tiny_engines.model))
    oa = openai.OpenAI(base_url=f"{ps.url}/v1", api_key="k", max_retries=0)
    request.addfinalizer(oa.close)
    r = oa.chat.completions.create(
        model="tiny",
        max_tokens=6,
        messages=[{"role": "user", "content": "hi"}],
        logprobs=True,
        top_logprobs=3,
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    rec = [c for c in read_records(ps.log_path) if isinstance(c, Call)][-1]
    assert content is not None and len(content) == rec.output_ids.size
    assert np.allclose([e.logprob for e in content], rec.output_logprobs, atol=1e-6)
    for e in content:
        assert len(e.top_logprobs) == 3
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True) and e.logprob <= tops[0] + 1e-6


def test_an_engine_that_goes_away_and_comes_back(
    tiny_engines: TinyEngines, make_proxy: Any, request: Any
) -> None:
    """A real gyre-engine, the proxy's only engine, is stopped: calls get 529 while nothing answers and the
    engine stays in the pool, set aside. Started again on the same address, it passes the proxy's health
    check and takes calls again, with no scheduler involved. (It restarts engine 1, so later tests of the session get the new one.)"""
    url = tiny_engines.urls[1]
    ps = make_proxy([url], tokenizer=str(tiny_engines.model), pick_wait_s=1.0, engine_retry_max_s=0.5)
    client = anthropic.Anthropic(base_url=ps.url, api_key="k", max_retries=0)
    request.addfinalizer(client.close)
    ask: dict[str, Any] = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    assert client.messages.create(**ask).usage.output_tokens >= 1
    tiny_engines.procs[1].stop()  # the engine goes away
    with pytest.raises(anthropic.APIStatusError) as e:
        client.messages.create(**ask)
    assert e.value.status_code == 529
    stats = httpx.get(f"{ps.url}/gyre/stats").json()
    assert [(x["url"], x["state"]) for x in stats["engines"]] == [(url, "failed")]
    port = int(url.rsplit(":", 1)[1])
    tiny_engines.procs[1] = again = EngineProc(tiny_engines.model, tiny_engines.logs / "engine1.log", port)
    again.wait_ready()  # and comes back
    deadline = time.monotonic() + 10
    while httpx.get(f"{ps.url}/gyre/stats").json()["engines"][0]["state"] != "active":
        assert time.monotonic() < deadline, "the proxy did not take the engine back"
        time.sleep(0.05)
    assert client.messages.create(**ask).usage.output_tokens >= 1
    e0 = httpx.get(f"{ps.url}/gyre/stats").json()["engines"][0]
    assert (e0["failures"], e0["revived"]) == (1, 1)


@pytest.mark.parametrize("breaker", ["\u2028", "\u2029", "\x85"])
def test_an_execution_id_with_a_line_separator_streams_whole(
    tiny_engines: TinyEngines, make_proxy: Any, breaker: str
) -> None:
    """Found by the fuzz tests in CI: gyre-engine's chunks carry the call's rid (execution id / call id)
    as JSON, which leaves U+2028, U+2029 and U+0085 unescaped, and httpx's line splitting broke each
    chunk there: every attempt failed as a bad chunk until the call gave up with a 5xx."""
    ps = make_proxy(tiny_engines.urls[:1], tokenizer=str(tiny_engines.model))
    ex = f"run{breaker}7"
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(f"{ps.url}/e/{quote(ex, safe='')}/v1/messages", json=body, timeout=60)
    assert r.status_code == 200, r.text
    rec = [c for c in read_records(ps.log_path) if isinstance(c, Call)][-1]
    assert rec.execution_id == ex and rec.output_ids.size >= 1
    assert httpx.get(f"{ps.url}/gyre/stats", timeout=10).json()["engine_errors"] == 0


def test_executions_move_to_an_engine_that_joins_later_with_their_kv(
    tiny_engines: TinyEngines, make_proxy: Any, sched_stub: Any, request: Any
) -> None:
    """Four executions make their first call on engine 0, the only one; then engine 1 joins (a cell back
    from training). Their next calls spread: two move to engine 1 (4 live vs 0, then 3 vs 1; at 2 vs 2
    they stay), each taking its cached context along over gyre-xfer's shared memory, so engine 1
    computes only the new turn; the records stay exact (each input extends the last input + output).
    With affinity alone all four stayed on engine 0 and engine 1 idled."""
    from gyre_sched.protocol import EngineAdd, Hello, Welcome

    urls, model = tiny_engines.urls, tiny_engines.model
    ps = make_proxy([], tokenizer=str(model), sched=sched_stub.endpoint)
    sched_stub.expect(Hello)
    sched_stub.send(Welcome())
    sched_stub.send(EngineAdd(0, urls[0]))
    deadline = time.monotonic() + 10
    while not ps.proxy.pool or not ps.proxy.pool.engines:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    client = anthropic.Anthropic(base_url=ps.url, api_key="k", max_retries=0)
    request.addfinalizer(client.close)
    before = [httpx.get(f"{u}/server_info").json() for u in urls]
    convs: dict[str, list[Any]] = {}
    for i in range(4):
        ex = f"rebal-{i}"
        msgs: list[Any] = [{"role": "user", "content": f"Question {i}: count the words of a long sentence."}]
        r = _call(client, ps.url, ex, msgs)
        convs[ex] = [*msgs, {"role": "assistant", "content": r}, {"role": "user", "content": "Go on."}]
    sched_stub.send(EngineAdd(1, urls[1]))
    while len(ps.proxy.pool.engines) < 2:
        assert time.monotonic() < deadline + 10
        time.sleep(0.02)
    for ex, msgs in convs.items():
        _call(client, ps.url, ex, msgs)
    stats = httpx.get(f"{ps.url}/gyre/stats").json()
    assert stats["rebalanced_calls"] == 2
    assert stats["prefix_moved_calls"] == 2 and stats["prefix_moved_tokens"] > 0
    after = [httpx.get(f"{u}/server_info").json() for u in urls]
    served = {e["id"]: e["served"] for e in stats["engines"]}
    assert served == {0: 6, 1: 2}
    recs = [r for r in read_records(ps.log_path) if isinstance(r, Call)]
    inputs = _full(recs)
    by_ex: dict[str, list[int]] = {}
    for r, inp in zip(recs, inputs, strict=True):
        if r.execution_id in by_ex:  # the second call extends the first call's input + output exactly
            first = by_ex[r.execution_id]
            assert inp.tolist()[: len(first)] == first
        by_ex[r.execution_id] = np.concatenate([inp, r.output_ids]).tolist()
    moved_in = after[1]["prefill_tokens_cached"] - before[1]["prefill_tokens_cached"]
    assert (
        moved_in >= stats["prefix_moved_tokens"] - 2
    )  # engine 1 reused what arrived (last token recomputed)


def _call(client: anthropic.Anthropic, url: str, ex: str, msgs: list[Any]) -> list[dict[str, Any]]:
    r = client.messages.create(
        model="tiny",
        max_tokens=8,
        messages=msgs,
        extra_headers={"x-gyre-execution": ex},
        extra_body={"temperature": 0.0},
    )
    return [b.model_dump(exclude_none=True) for b in r.content] or [{"type": "text", "text": ""}]


def test_records_name_the_engines_and_the_cached_input(
    tiny_engines: TinyEngines, make_proxy: Any, request: Any
) -> None:
    """Each record's metadata says which engine served the call and how much of its input that engine
    found in its prefix cache: what `gyre run` measures engine shares and prefix-cache hits from."""
    urls, model = tiny_engines.urls, tiny_engines.model
    ps = make_proxy(urls[1:], tokenizer=str(model))
    client = anthropic.Anthropic(base_url=ps.url, api_key="k", max_retries=0)
    request.addfinalizer(client.close)
    msgs: list[Any] = [{"role": "user", "content": "Name three colours, then three more."}]
    first = _call(client, ps.url, "meta-0", msgs)
    _call(
        client,
        ps.url,
        "meta-0",
        [*msgs, {"role": "assistant", "content": first}, {"role": "user", "content": "More."}],
    )
    recs = [r for r in read_records(ps.log_path) if isinstance(r, Call)]
    assert [r.metadata["engines"] for r in recs] == ["0", "0"]
    first_in = _full(recs)[0].size
    assert int(recs[0].metadata["cached_tokens"]) < first_in
    assert int(recs[1].metadata["cached_tokens"]) >= first_in  # the first call's context came from the cache


def test_outputs_of_a_given_length_with_ignore_eos_and_the_next_call_extends_them(
    tiny_engines: TinyEngines, make_proxy: Any, request: Any
) -> None:
    """`ignore_eos` (SGLang's and vLLM's OpenAI extension) samples to the budget: exactly `max_tokens`
    tokens, end-of-turn tokens included as sampled; the next call of the conversation still extends the
    recorded input + output exactly. `min_tokens` beyond `max_tokens` is a 400 naming it."""
    urls, model = tiny_engines.urls, tiny_engines.model
    ps = make_proxy(urls[:1], tokenizer=str(model))
    oa = openai.OpenAI(base_url=f"{ps.url}/v1", api_key="k", max_retries=0)
    request.addfinalizer(oa.close)
    msgs: list[Any] = [{"role": "user", "content": "Say something long."}]
    r = oa.chat.completions.create(
        model="tiny",
        max_tokens=40,
        messages=msgs,
        extra_body={"ignore_eos": True},
        extra_headers={"x-gyre-execution": "len-0"},
    )
    assert r.usage is not None and r.usage.completion_tokens == 40
    msgs += [
        {"role": "assistant", "content": r.choices[0].message.content or ""},
        {"role": "user", "content": "Go on."},
    ]
    r2 = oa.chat.completions.create(
        model="tiny",
        max_tokens=25,
        messages=msgs,
        extra_body={"ignore_eos": True},
        extra_headers={"x-gyre-execution": "len-0"},
    )
    assert r2.usage is not None and r2.usage.completion_tokens == 25
    recs = [c for c in read_records(ps.log_path) if isinstance(c, Call)]
    assert [c.output_ids.size for c in recs] == [40, 25]
    first = np.concatenate([_full(recs)[0], recs[0].output_ids]).tolist()
    assert _full(recs)[1].tolist()[: len(first)] == first
    assert httpx.get(f"{ps.url}/gyre/stats").json()["non_extensions"] == 0
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        oa.chat.completions.create(model="tiny", max_tokens=5, messages=msgs, extra_body={"min_tokens": 6})
