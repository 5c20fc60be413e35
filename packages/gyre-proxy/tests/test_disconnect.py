"""A client that leaves takes its engine work with it: against a real gyre-engine (the tiny model on the
CPU), a client that disconnects mid-generation, streaming or not, in either API, leaves 0 rows generating
on the engine, 0 calls in flight in the proxy and nothing in the record log; an engine-side abort after
it does not bring the call back; the next client is served and recorded as usual."""

from __future__ import annotations

import json
import random
import socket
import time
from typing import Any

import httpx
import pytest
from gyre_base.testing import until
from gyre_traj.io import read_records
from gyre_traj.records import Call

from .conftest import EngineProc, TinyEngines, left_to_gc

pytestmark = pytest.mark.slow

LONG = 20000  # tokens: minutes of generation for the tiny model on this CPU, were it not aborted


def _body(api: str, stream: bool) -> tuple[str, dict[str, Any]]:
    msgs = [{"role": "user", "content": "count to a million"}]
    if api == "anthropic":
        return "/v1/messages", {
            "model": "m",
            "max_tokens": LONG,
            "messages": msgs,
            "stream": stream,
            "temperature": 0,
        }
    return "/v1/chat/completions", {
        "model": "m",
        "max_tokens": LONG,
        "messages": msgs,
        "stream": stream,
        "temperature": 0,
    }


def _send(url: str, path: str, body: dict[str, Any]) -> socket.socket:
    """A raw HTTP/1.1 request; the caller disconnects by closing the socket."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    s = socket.create_connection((host, int(port)), timeout=30)
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    s.sendall(head.encode() + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def _stats(url: str) -> dict[str, Any]:
    out: dict[str, Any] = httpx.get(f"{url}/gyre/stats", timeout=10).json()
    return out


def _in_flight(url: str) -> int:
    return sum(e["in_flight"] for e in _stats(url)["engines"])


def _calls(ps: Any) -> list[Call]:
    return [r for r in read_records(ps.log_path) if isinstance(r, Call)]


def _engine(tiny: TinyEngines) -> EngineProc:
    eng = tiny.procs[0]
    until(lambda: eng.rows() == 0, "engine 0 idle before the test")
    return eng


@pytest.mark.parametrize(
    ("api", "stream"), [("anthropic", False), ("openai", False), ("anthropic", True), ("openai", True)]
)
def test_a_client_that_leaves_mid_generation_leaves_nothing_running_or_recorded(
    tiny_engines: TinyEngines, make_proxy: Any, api: str, stream: bool
) -> None:
    eng = _engine(tiny_engines)
    ps = make_proxy([eng.url], tokenizer=str(tiny_engines.model))
    path, body = _body(api, stream)
    sock = _send(ps.url, path, body)
    until(lambda: eng.rows() == 1, "the call generating on the engine")
    if stream:
        assert sock.recv(1), "the stream started"
    sock.close()  # the client leaves mid-generation
    until(lambda: eng.rows() == 0, "the engine no longer generating for the client that left")
    until(lambda: _in_flight(ps.url) == 0, "no call in flight in the proxy")
    st = _stats(ps.url)
    assert (st["abandoned_calls"], st["records_written"], st["records_unanswered"]) == (1, 0, 0)
    assert _calls(ps) == []
    # the next client is served and recorded as usual
    ok = dict(body, max_tokens=3, stream=False)
    r = httpx.post(f"{ps.url}{path}", json=ok, timeout=60)
    assert r.status_code == 200, r.text
    assert len(_calls(ps)) == 1


def test_an_engine_side_abort_does_not_bring_back_a_call_whose_client_left(
    tiny_engines: TinyEngines, make_proxy: Any
) -> None:
    """The issue's fuzzing saw the proxy resubmit abandoned calls after the engine aborted them, up to 150
    in flight while the engine ran one. Here eight clients leave, the engine aborts everything at once,
    and nothing comes back."""
    eng = _engine(tiny_engines)
    ps = make_proxy([eng.url], tokenizer=str(tiny_engines.model))
    socks = [_send(ps.url, *_body("anthropic" if i % 2 else "openai", False)) for i in range(8)]
    until(lambda: eng.rows() == 8, "all eight calls on the engine")
    for s in socks:
        s.close()
    httpx.post(f"{eng.url}/abort_request", json={"abort_all": True}, timeout=10).raise_for_status()
    until(lambda: _in_flight(ps.url) == 0, "no call in flight in the proxy")
    until(lambda: eng.rows() == 0, "nothing generating on the engine")
    time.sleep(0.5)  # a resubmission would have reached the engine by now
    assert eng.rows() == 0 and _in_flight(ps.url) == 0
    assert _stats(ps.url)["abandoned_calls"] == 8 and _calls(ps) == []


def test_clients_leaving_while_calls_wait_for_an_engine_connection_leak_nothing(
    engine: Any, make_proxy: Any
) -> None:
    """Found by the fuzz tests in CI: a call cancelled (its client left) while its engine request waited
    for a connection slot leaked that slot for good in a capped httpx pool (httpx 0.28 / httpcore 1.0.9),
    and once the pool was full of dead slots every later call through it hung. Here rounds of 160
    clients on one execution (so one pool) leave at random moments; then a call is still answered, and
    no engine connection (stream or abort) is left unclosed, neither while the proxy runs nor once it
    stopped with hundreds of aborts still queued."""
    engine.default = "a b c d e f g h i j k l"
    engine.token_delay_s = 0.01
    ps = make_proxy([engine.url], pick_wait_s=30.0)
    rng = random.Random(0)

    def churn() -> None:
        socks = [_send(ps.url, *_body("anthropic" if i % 2 else "openai", True)) for i in range(160)]
        for s in rng.sample(socks, len(socks)):
            time.sleep(rng.random() * 0.002)
            s.close()

    for _ in range(3):
        churn()
        until(lambda: _in_flight(ps.url) == 0, "no call in flight in the proxy")
    path, body = _body("anthropic", False)
    r = httpx.post(f"{ps.url}{path}", json=dict(body, max_tokens=3), timeout=30)
    assert r.status_code == 200, r.text
    assert _stats(ps.url)["abandoned_calls"] > 0
    churn()  # and the proxy stops at once, its calls' aborts still queued
    # Every engine connection of a cancelled call (its stream, its abort) was closed by the proxy itself,
    # while it runs and when it stops with aborts still queued: none is left for the garbage collector.
    assert left_to_gc() == []
    ps.server.stop()
    assert left_to_gc() == []
