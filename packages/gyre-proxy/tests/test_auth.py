"""The run token on the proxy's ZeroMQ sockets (`gyre_base.sockets`): the control DEALER reaches a scheduler
that requires the token only when it holds the token, and records reach a token-bound PULL only from a
proxy holding it (configured, or from $GYRE_TOKEN). A proxy without the token is refused by both, keeps
serving and keeps its log."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest
import zmq
from gyre_base.sockets import bind, make_socket
from gyre_base.token import TOKEN_ENV
from gyre_sched.client import dealer
from gyre_sched.policy import WaterLevelConfig, WaterLevelPolicy
from gyre_sched.protocol import Codec as SchedCodec
from gyre_sched.protocol import Hello, PeerKind, Welcome
from gyre_sched.service import Scheduler, ServiceConfig
from gyre_traj.io import Codec, read_records
from gyre_traj.records import Call

TOKEN = "proxy-test-run-token-0123456789"
ASK: dict[str, Any] = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def scheduler(engine: Any, no_token: None) -> Iterator[Scheduler]:
    """A real gyre-sched Scheduler bound with the token, and a cell registered through it."""
    cfg = ServiceConfig(bind="tcp://127.0.0.1:0", heartbeat_s=0.1, failure_timeout_s=5.0, token=TOKEN)
    sched = Scheduler(WaterLevelPolicy(WaterLevelConfig(hold_s=60.0, ready_fraction=1.0)), cfg)
    th = threading.Thread(target=sched.serve_forever, daemon=True)
    th.start()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    cell = dealer(ctx, sched.endpoint, TOKEN)
    codec = SchedCodec()
    cell.send(codec.encode(Hello(PeerKind.CELL, cell_id=7, capacity=8, endpoint=engine.url)))
    assert cell.poll(10000) and isinstance(codec.decode(cell.recv()), Welcome)
    try:
        yield sched
    finally:
        cell.close()
        ctx.term()
        sched.stop()
        th.join(5.0)


def test_control_link_reaches_the_scheduler_with_the_run_token(
    scheduler: Scheduler, engine: Any, make_proxy: Any, request: Any
) -> None:
    ps = make_proxy([], sched=scheduler.endpoint, token=TOKEN, pick_wait_s=20.0)
    client = anthropic.Anthropic(base_url=ps.url, api_key="k", max_retries=0)
    request.addfinalizer(client.close)
    engine.script = ["routed with the token"]
    r = client.messages.create(**ASK)
    assert r.content[0].text == "routed with the token"  # type: ignore[union-attr]
    assert [e.engine_id for e in ps.proxy.pool.engines.values()] == [7]  # type: ignore[union-attr]


def test_control_link_without_the_token_is_refused_and_the_proxy_keeps_serving(
    scheduler: Scheduler, make_proxy: Any
) -> None:
    ps = make_proxy([], sched=scheduler.endpoint, pick_wait_s=1.0)
    r = httpx.post(f"{ps.url}/v1/messages", json=ASK, timeout=30)
    assert r.status_code == 529 and r.json()["error"]["type"] == "overloaded_error"
    st = httpx.get(f"{ps.url}/gyre/stats").json()
    assert st["engines"] == [] and st["control"] == []
    assert httpx.get(f"{ps.url}/health").status_code == 200


@pytest.fixture
def pull(no_token: None) -> Iterator[tuple[zmq.Socket[bytes], str]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = make_socket(ctx, zmq.PULL)
    endpoint = bind(sock, "tcp://127.0.0.1:0", TOKEN)
    try:
        yield sock, endpoint
    finally:
        sock.close()
        ctx.term()


def _received(sock: zmq.Socket[bytes], n: int, wait_s: float) -> list[str]:
    codec, got = Codec(), []
    deadline = time.monotonic() + wait_s
    while len(got) < n and time.monotonic() < deadline:
        if sock.poll(50):
            rec = codec.decode_msgpack(sock.recv())
            assert isinstance(rec, Call)
            got.append(rec.call_id)
    return got


def test_records_reach_a_token_bound_pull_only_with_the_token(
    pull: tuple[zmq.Socket[bytes], str], engine: Any, make_proxy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    sock, endpoint = pull
    holder = make_proxy([engine.url], record_push=endpoint, token=TOKEN)
    assert httpx.post(f"{holder.url}/v1/messages", json=ASK).status_code == 200
    logged = [r.call_id for r in read_records(holder.log_path) if isinstance(r, Call)]
    assert _received(sock, 1, 10.0) == logged
    # the token from the environment, as every gyre process reads it
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    from_env = make_proxy([engine.url], record_push=endpoint)
    assert httpx.post(f"{from_env.url}/v1/messages", json=ASK).status_code == 200
    assert len(_received(sock, 1, 10.0)) == 1
    # no token: the PULL never hears from it; the call is answered and its record is in the log
    monkeypatch.delenv(TOKEN_ENV)
    intruder = make_proxy([engine.url], record_push=endpoint)
    assert httpx.post(f"{intruder.url}/v1/messages", json=ASK).status_code == 200
    assert len([r for r in read_records(intruder.log_path) if isinstance(r, Call)]) == 1
    assert _received(sock, 1, 1.5) == []
