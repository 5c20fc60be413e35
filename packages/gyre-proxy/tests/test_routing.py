"""Routing over engines: session affinity, least outstanding work, drain and removal through the control
socket (gyre-sched's protocol over a real ZeroMQ ROUTER), and continuation of drained or dead-engine
calls with the tokens already generated kept, so the harness sees one uninterrupted response."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from typing import Any

import anthropic
import httpx
import numpy as np
import pytest
from gyre_base.testing import until_async
from gyre_sched.protocol import (
    EngineAdd,
    EngineDrain,
    EngineDrained,
    EngineRemove,
    Hello,
    PeerKind,
    Welcome,
)
from gyre_traj.io import read_records
from gyre_traj.records import Call
from tokenizers import Tokenizer

from .conftest import left_to_gc

LONG = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen"


def _records(path: Any) -> list[Call]:
    return [r for r in read_records(path) if isinstance(r, Call)]


def _continuation(tokenizer: Tokenizer, text: str) -> tuple[list[int], Any]:
    """The full output ids of `text`, and a script item that emits what a first engine did not."""
    full = [*tokenizer.encode(text, add_special_tokens=False).ids, tokenizer.token_to_id("<|im_end|>")]
    state: dict[str, int] = {}

    def rest(ids: list[int]) -> list[int]:
        # the continuation's input ends with the partial output: find how much of `full` it already has
        for k in range(len(full), 0, -1):
            if ids[-k:] == full[:k]:
                state["k"] = k
                return full[k:]
        return full

    return full, rest


def _stats(url: str) -> dict[str, Any]:
    import httpx

    return httpx.get(f"{url}/gyre/stats").json()  # type: ignore[no-any-return]


def test_affinity_and_least_outstanding(
    tokenizer: Tokenizer, make_proxy: Any, request: Any, engines2: Any
) -> None:
    a, b = engines2
    ps = make_proxy([a.url, b.url])
    client = anthropic.Anthropic(base_url=ps.url, api_key="k", max_retries=0)
    request.addfinalizer(client.close)
    for ex in ("x1", "x1", "x1"):
        client.messages.create(
            model="m",
            max_tokens=20,
            messages=[{"role": "user", "content": "hi"}],
            extra_headers={"x-gyre-execution": ex},
        )
    assert (len(a.seen), len(b.seen)) in ((3, 0), (0, 3))  # one execution stays on one engine
    a.token_delay_s = b.token_delay_s = 0.02
    a.script = [LONG] * 4
    b.script = [LONG] * 4
    done: list[str] = []

    def call(ex: str) -> None:
        with anthropic.Anthropic(base_url=ps.url, api_key="k", max_retries=0) as c:
            c.messages.create(
                model="m",
                max_tokens=40,
                messages=[{"role": "user", "content": ex}],
                extra_headers={"x-gyre-execution": ex},
            )
        done.append(ex)

    before = (len(a.seen), len(b.seen))
    ts = [threading.Thread(target=call, args=(f"y{i}",)) for i in range(4)]
    for t in ts:
        t.start()
        time.sleep(0.05)
    for t in ts:
        t.join(30)
    assert len(done) == 4
    assert (len(a.seen) - before[0], len(b.seen) - before[1]) == (2, 2)  # spread by outstanding work


def test_drain_moves_call_with_tokens_kept(
    tokenizer: Tokenizer, make_proxy: Any, request: Any, engines2: Any, sched_stub: Any
) -> None:
    a, b = engines2
    sched = sched_stub
    ps = make_proxy([], sched=sched.endpoint)
    hello = sched.expect(Hello)
    assert hello.kind is PeerKind.PROXY
    sched.send(Welcome())
    sched.send(EngineAdd(0, a.url))
    deadline = time.monotonic() + 10
    while not _stats(ps.url)["engines"] and time.monotonic() < deadline:
        time.sleep(0.02)
    full, rest = _continuation(tokenizer, LONG)
    a.script = [LONG]
    b.script = [rest]
    a.token_delay_s = 0.05
    client = anthropic.Anthropic(base_url=ps.url, api_key="k", max_retries=0)
    request.addfinalizer(client.close)
    result: dict[str, Any] = {}

    def call() -> None:
        with client.messages.stream(
            model="m", max_tokens=100, messages=[{"role": "user", "content": "count"}]
        ) as st:
            result["text"] = "".join(st.text_stream)

    t = threading.Thread(target=call)
    t.start()
    deadline = time.monotonic() + 10
    while not a.seen and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)  # a few tokens out of engine A
    sched.send(EngineAdd(1, b.url))
    sched.send(EngineDrain(0))
    drained = sched.expect(EngineDrained)
    assert drained.cell_id == 0
    t.join(30)
    assert result["text"] == LONG  # one uninterrupted response
    rec = _records(ps.log_path)[-1]
    assert rec.output_ids.tolist() == full
    k = len(a.outputs[0])
    assert 0 < k < len(full)
    assert b.seen[0].input_ids == a.seen[0].input_ids + full[:k]  # continuation = input + partial output
    assert b.seen[0].max_new_tokens == 100 - k
    lps = [a.logprob(i, t) for i, t in enumerate(full[:k])] + [
        b.logprob(i, t) for i, t in enumerate(full[k:])
    ]
    assert np.allclose(rec.output_logprobs, lps)
    st = _stats(ps.url)
    assert st["moved_calls"] == 1 and st["reprefilled_tokens"] == len(b.seen[0].input_ids)
    sched.send(EngineRemove(0))
    deadline = time.monotonic() + 10
    while len(_stats(ps.url)["engines"]) != 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [e["id"] for e in _stats(ps.url)["engines"]] == [1]


def test_dead_engine_call_continues(
    tokenizer: Tokenizer, make_proxy: Any, request: Any, engines2: Any
) -> None:
    a, b = engines2
    full, rest = _continuation(tokenizer, LONG)
    a.script = [LONG]
    a.die_after = 4
    b.script = [rest]
    ps = make_proxy([a.url, b.url])
    client = anthropic.Anthropic(base_url=ps.url, api_key="k", max_retries=0)
    request.addfinalizer(client.close)
    # put the execution on engine A first
    ps.proxy.pool.affinity["dead-1"] = 0  # type: ignore[union-attr]
    r = client.messages.create(
        model="m",
        max_tokens=100,
        messages=[{"role": "user", "content": "count"}],
        extra_headers={"x-gyre-execution": "dead-1"},
    )
    assert r.content[0].type == "text" and r.content[0].text == LONG
    rec = _records(ps.log_path)[-1]
    assert rec.output_ids.tolist() == full
    assert b.seen[0].input_ids[: len(a.seen[0].input_ids)] == a.seen[0].input_ids
    # the connection failure set engine 0 aside; it still answers its health check, so it is back
    deadline = time.monotonic() + 10
    while _stats(ps.url)["engines"][0]["state"] != "active" and time.monotonic() < deadline:
        time.sleep(0.05)
    e0 = _stats(ps.url)["engines"][0]
    assert (e0["id"], e0["state"], e0["failures"], e0["revived"]) == (0, "active", 1, 1)


class _ClosesFirstConnection:
    """TEST FIXTURE: a TCP front for an engine that reads the first connection's request and closes it
    unanswered (as a server does to a kept-alive connection its idle timeout ended just as a request went
    out), then forwards every later connection to the engine."""

    def __init__(self, upstream: str) -> None:
        import socket

        host, port = upstream.removeprefix("http://").rsplit(":", 1)
        self.upstream = (host, int(port))
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.dropped = 0
        self.conns: list[Any] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if not self.dropped:
                conn.recv(65536)
                self.dropped += 1
                conn.close()
                continue
            up = socket.create_connection(self.upstream)
            self.conns += [conn, up]
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: Any, dst: Any) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(2)

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def test_a_connection_closed_before_the_engine_answered_is_tried_again_on_a_new_one(
    tokenizer: Tokenizer, make_proxy: Any, request: Any, engine: Any
) -> None:
    """The only engine closes the connection a request went out on without answering (a kept-alive
    connection at the end of its idle timeout): the call goes again on a new connection to the same
    engine and completes exactly; the engine is not set aside (without this the call failed: the only
    engine excluded, nothing left to pick)."""
    front = _ClosesFirstConnection(engine.url)
    request.addfinalizer(front.close)
    engine.script = [LONG]
    ps = make_proxy([front.url], pick_wait_s=0.5)
    client = anthropic.Anthropic(base_url=ps.url, api_key="k", max_retries=0)
    request.addfinalizer(client.close)
    r = client.messages.create(model="m", max_tokens=100, messages=[{"role": "user", "content": "count"}])
    assert r.content[0].type == "text" and r.content[0].text == LONG
    assert front.dropped == 1 and len(engine.seen) == 1
    full = [*tokenizer.encode(LONG, add_special_tokens=False).ids, tokenizer.token_to_id("<|im_end|>")]
    assert _records(ps.log_path)[-1].output_ids.tolist() == full
    stats = _stats(ps.url)
    e0 = stats["engines"][0]
    assert (e0["state"], e0["failures"]) == ("active", 0)
    assert stats["engine_errors"] == 1


def test_an_engine_that_fails_comes_back(
    tokenizer: Tokenizer, make_proxy: Any, request: Any, engine: Any
) -> None:
    """The only, statically configured engine: a connection failure mid-call sets it aside, its health
    check brings it back at once and the call continues on it; then the engine goes away (its server
    stops: calls get 529 while none answers) and comes back on the same address (a new server), and it
    takes calls again without anyone adding it: only the scheduler removes an engine for good."""
    full, rest = _continuation(tokenizer, LONG)
    engine.script = [LONG, rest]
    engine.die_after = 4
    ps = make_proxy([engine.url], pick_wait_s=1.0, engine_retry_s=0.05, engine_retry_max_s=0.2)
    client = anthropic.Anthropic(base_url=ps.url, api_key="k", max_retries=0)
    request.addfinalizer(client.close)
    ask: dict[str, Any] = {
        "model": "m",
        "max_tokens": 100,
        "messages": [{"role": "user", "content": "count"}],
    }
    r = client.messages.create(**ask)
    assert r.content[0].type == "text" and r.content[0].text == LONG
    assert _records(ps.log_path)[-1].output_ids.tolist() == full
    e0 = _stats(ps.url)["engines"][0]
    assert (e0["state"], e0["failures"], e0["revived"]) == ("active", 1, 1)

    port = int(engine.url.rsplit(":", 1)[1])
    engine.stop()  # the engine goes away
    with pytest.raises(anthropic.APIStatusError) as e:
        client.messages.create(**ask)
    assert e.value.status_code == 529 and _stats(ps.url)["engines"][0]["state"] == "failed"
    back = type(engine)(tokenizer, script=["back again"]).start(port)  # and comes back
    request.addfinalizer(back.stop)
    deadline = time.monotonic() + 10
    while _stats(ps.url)["engines"][0]["state"] != "active" and time.monotonic() < deadline:
        time.sleep(0.05)
    r = client.messages.create(**ask)
    assert r.content[0].type == "text" and r.content[0].text == "back again"
    e0 = _stats(ps.url)["engines"][0]
    assert (e0["id"], e0["state"], e0["failures"], e0["revived"]) == (0, "active", 2, 2)


@pytest.mark.slow
@pytest.mark.long
def test_an_engine_set_aside_is_revived_while_a_thousand_calls_are_in_flight(
    tokenizer: Tokenizer, make_proxy: Any, engine: Any
) -> None:
    """1,000 streaming calls run on the only engine; 300 of their clients leave, and the engine takes
    their aborts but does not answer them (too busy); then one call's connection breaks, which sets the
    engine aside. Its health checks (with backoff) bring it back within seconds while the other 700
    calls are still in flight: neither the load nor the hanging aborts can fill the pool the probes use.
    The broken call then continues on it, and every call whose client stayed gets its whole answer."""
    n, leaving = 1000, 300
    engine.token_delay_s = 0.25
    engine.default = "ok " * 16
    engine.hold_aborts = threading.Event()
    engine.hold_aborts.set()
    ps = make_proxy([engine.url], pick_wait_s=60.0, engine_retry_s=0.05, engine_retry_max_s=0.5)
    pool = ps.proxy.pool
    ask = {"model": "m", "max_tokens": 40, "stream": True, "messages": [{"role": "user", "content": "go"}]}
    body = json.dumps(ask).encode()

    async def stay(c: httpx.AsyncClient, i: int) -> str:
        r = await c.post(f"{ps.url}/v1/messages", content=body, headers={"x-gyre-execution": f"s{i}"})
        assert r.status_code == 200, r.text
        return r.text

    async def leave(i: int) -> None:
        _, writer = await asyncio.open_connection("127.0.0.1", ps.server.port)
        head = f"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
        writer.write(f"{head}x-gyre-execution: l{i}\r\n\r\n".encode() + body)
        await writer.drain()
        while len(engine.seen) < n:
            await asyncio.sleep(0.1)
        writer.close()
        await writer.wait_closed()

    async def main() -> list[str]:
        limits = httpx.Limits(max_connections=n)
        async with httpx.AsyncClient(timeout=300, limits=limits) as c:
            stayed = [asyncio.create_task(stay(c, i)) for i in range(n - leaving)]
            await asyncio.gather(*(leave(i) for i in range(leaving)))
            await until_async(lambda: pool.aborts_sent >= leaving, "an abort sent for every client gone", 60)
            await until_async(lambda: len(engine.aborted) >= 16, "aborts hanging at the engine", 60)
            engine.die_after = 0  # the next call's connection breaks: the engine is set aside
            broken = asyncio.create_task(stay(c, n))
            eng = pool.engines[0]
            await until_async(lambda: eng.failures == 1, "the engine set aside", 60)
            await until_async(lambda: eng.revived == 1, "the engine revived", 15)
            assert sum(not t.done() for t in stayed) > 0  # still under load: clients wait on their calls
            out = await asyncio.gather(*stayed, broken)
            engine.hold_aborts.clear()
            return out

    texts = asyncio.run(main())
    assert len(texts) == n - leaving + 1
    assert all(t.rstrip().endswith('data: {"type":"message_stop"}') for t in texts)
    assert pool.engines[0].state.value == "active"
    # no engine connection of a call cancelled under this churn (its stream, its abort) is left unclosed
    assert left_to_gc() == []
    ps.server.stop()
    assert left_to_gc() == []
