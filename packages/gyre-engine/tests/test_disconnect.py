"""No generation outlives its client: plain calls, batches and streams whose client leaves are
aborted, and a batch refused halfway leaves none of its rows running. Against a real server subprocess
with the tiny model; each long request asks for 30,000 tokens, minutes of work on this machine, so a
server that did not abort it would still be running it when the wait below gives up."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from gyre_engine.client import EngineClient
from gyre_engine.protocol import SamplingParams

torch = pytest.importorskip("torch")

USER = [1200 + i * 7 for i in range(9)]
LONG = {"max_new_tokens": 30000, "temperature": 0.0, "ignore_eos": True}
IDLE_WAIT_S = 30.0
"""How long an aborted request may take to leave the engine (it takes one engine step; the machine is
shared and slow, hence the margin)."""


async def in_flight(c: EngineClient) -> int:
    info = await c.server_info()
    return info.running_requests + info.waiting_requests


async def wait_idle(c: EngineClient) -> None:
    """Returns once nothing runs or waits; fails after IDLE_WAIT_S."""
    for _ in range(int(IDLE_WAIT_S / 0.05)):
        if await in_flight(c) == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{await in_flight(c)} abandoned generations still in the engine")


async def wait_running(c: EngineClient, n: int) -> None:
    while (await c.server_info()).running_requests < n:
        await asyncio.sleep(0.02)


def test_plain_calls_whose_client_timed_out_are_aborted_not_stacked(server: Any) -> None:
    """A harness that times out and retries three times leaves at most its live attempt running, and
    none once it gives up (before the fix every attempt kept generating: rows stacked up)."""

    async def go() -> None:
        async with EngineClient(server.url, timeout_s=60) as c:
            await wait_idle(c)
            body = {"input_ids": USER, "sampling_params": LONG}
            for _attempt in range(3):
                async with httpx.AsyncClient(timeout=60) as h:
                    call = asyncio.create_task(h.post(f"{server.url}/generate", json=body))
                    await wait_running(c, 1)
                    call.cancel()  # the client gives up: its connection closes
                    with pytest.raises(asyncio.CancelledError):
                        await call
                await wait_idle(c)
            ok = await c.generate(USER, SamplingParams(max_new_tokens=2))
            assert ok.meta_info.completion_tokens == 2

    asyncio.run(go())


def test_a_batch_whose_client_leaves_is_aborted_row_by_row(server: Any) -> None:
    async def go() -> None:
        async with EngineClient(server.url, timeout_s=60) as c, httpx.AsyncClient(timeout=60) as h:
            await wait_idle(c)
            body = {"input_ids": [USER, USER[:5], USER[:3]], "sampling_params": LONG}
            call = asyncio.create_task(h.post(f"{server.url}/generate", json=body))
            await wait_running(c, 3)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            await wait_idle(c)

    asyncio.run(go())


def test_a_batch_refused_halfway_leaves_no_row_running(server: Any) -> None:
    """Two inputs with one rid: the second is refused at admission (400), and the first, already
    admitted, must not go on generating for nobody."""

    async def go() -> None:
        async with EngineClient(server.url, timeout_s=60) as c, httpx.AsyncClient(timeout=60) as h:
            await wait_idle(c)
            body = {"input_ids": [USER, USER[:5]], "rid": ["twin", "twin"], "sampling_params": LONG}
            r = await h.post(f"{server.url}/generate", json=body)
            assert r.status_code == 400 and "already running" in r.json()["error"]["message"]
            await wait_idle(c)

    asyncio.run(go())


def test_a_stream_whose_client_leaves_before_or_after_its_first_chunk_is_aborted(server: Any) -> None:
    async def go() -> None:
        async with EngineClient(server.url, timeout_s=60) as c, httpx.AsyncClient(timeout=60) as h:
            await wait_idle(c)
            body = {"input_ids": USER, "sampling_params": LONG, "stream": True}
            async with h.stream("POST", f"{server.url}/generate", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        break  # leaves after the first chunk
            await wait_idle(c)
            async with h.stream("POST", f"{server.url}/generate", json=body) as r:
                assert r.status_code == 200  # leaves before reading anything
            await wait_idle(c)

    asyncio.run(go())


def test_events_of_a_request_outliving_its_server_loop_are_dropped() -> None:
    """The engine thread hands events to the HTTP loop's queue; once that loop has closed (uvicorn shut
    down with requests still running), the events are dropped quietly instead of raising on the engine
    thread for every such request. While the loop runs, they arrive."""
    import asyncio

    from gyre_engine.server.generate import event_sink
    from gyre_engine.server.request import TokenEvent

    ev = TokenEvent("r", [1], [0.0], None, None, 3, 0, "0")
    got: list[TokenEvent] = []
    sinks = []

    async def live() -> None:
        q: asyncio.Queue[TokenEvent] = asyncio.Queue()
        sinks.append(event_sink(asyncio.get_running_loop(), q))
        sinks[0](ev)
        got.append(await asyncio.wait_for(q.get(), 5.0))

    asyncio.run(live())  # runs the loop, then closes it
    assert got == [ev]
    sinks[0](ev)  # the loop is closed: dropped, no error
