"""Per-execution API keys bind their execution, /gyre/stats and /v1/models need a key where keys are set,
and every error, routing's 404/405 and an internal failure included, comes back in the API's JSON shape."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from gyre_traj.io import read_records
from gyre_traj.records import Call

KEYS = {"key-a": "run-a", "key-b": "run-b"}
ASK = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}


def _anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    return str(body["error"]["message"])


def _openai_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == kind and set(err) == {"message", "type", "param", "code"}, err
    return str(err["message"])


def test_a_key_writes_only_into_its_own_execution(engine: Any, make_proxy: Any) -> None:
    ps = make_proxy([engine.url], api_keys=KEYS)
    a = {"x-api-key": "key-a"}
    post = httpx.post
    msg = _anthropic_error(
        post(f"{ps.url}/e/run-b/v1/messages", json=ASK, headers=a), 403, "permission_error"
    )
    assert "'run-a' only, not 'run-b'" in msg
    _openai_error(
        post(f"{ps.url}/e/run-b/v1/chat/completions", json=ASK, headers={"authorization": "Bearer key-a"}),
        403,
        "permission_error",
    )
    _anthropic_error(
        post(f"{ps.url}/v1/messages", json=ASK, headers={**a, "x-gyre-execution": "run-b"}),
        403,
        "permission_error",
    )
    _anthropic_error(
        post(f"{ps.url}/e/run-b/v1/messages/count_tokens", json={"messages": ASK["messages"]}, headers=a),
        403,
        "permission_error",
    )
    _anthropic_error(post(f"{ps.url}/e/run-a/v1/messages", json=ASK), 401, "authentication_error")
    _openai_error(
        post(f"{ps.url}/v1/chat/completions", json=ASK, headers={"x-api-key": "key-c"}),
        401,
        "invalid_request_error",
    )
    assert engine.seen == []  # nothing refused reached the engine
    # its own execution, by path or by key alone (the harness's session header does not move it)
    assert post(f"{ps.url}/e/run-a/v1/messages", json=ASK, headers=a).status_code == 200
    session = {**a, "x-claude-code-session-id": "another-session"}
    assert post(f"{ps.url}/v1/messages", json=ASK, headers=session).status_code == 200
    assert post(f"{ps.url}/v1/chat/completions", json=ASK, headers={"x-api-key": "key-b"}).status_code == 200
    execs = [r.execution_id for r in read_records(ps.log_path) if isinstance(r, Call)]
    assert execs == ["run-a", "run-a", "run-b"]


def test_stats_and_models_need_a_key_where_keys_are_set(engine: Any, make_proxy: Any) -> None:
    keyed = make_proxy([engine.url], api_keys=KEYS)
    for path in ("/gyre/stats", "/v1/models"):
        _anthropic_error(httpx.get(f"{keyed.url}{path}"), 401, "authentication_error")
        _anthropic_error(
            httpx.get(f"{keyed.url}{path}", headers={"x-api-key": "nope"}), 401, "authentication_error"
        )
        assert httpx.get(f"{keyed.url}{path}", headers={"x-api-key": "key-b"}).status_code == 200
    assert httpx.get(f"{keyed.url}/health").status_code == 200  # liveness only, no data
    open_ = make_proxy([engine.url])  # loopback without keys: as before
    assert httpx.get(f"{open_.url}/gyre/stats").status_code == 200


def test_routing_errors_come_in_the_api_shape(engine: Any, make_proxy: Any) -> None:
    ps = make_proxy([engine.url])
    _anthropic_error(httpx.post(f"{ps.url}/v1/messagez", json=ASK), 404, "not_found_error")
    _anthropic_error(httpx.get(f"{ps.url}/v1/messages"), 405, "invalid_request_error")
    _openai_error(httpx.post(f"{ps.url}/v1/completions", json=ASK), 404, "invalid_request_error")
    msg = _openai_error(httpx.get(f"{ps.url}/e/x/v1/chat/completions"), 405, "invalid_request_error")
    assert msg == "GET /e/x/v1/chat/completions: method not allowed"


def test_an_internal_failure_is_a_500_in_the_api_shape(
    engine: Any, make_proxy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug anywhere in a call (here: rendering raises) is answered as the API answers its own failures,
    never as a plain-text page, and the proxy goes on serving."""
    ps = make_proxy([engine.url])

    def broken(*args: Any, **kw: Any) -> Any:
        raise KeyError("a bug")

    with monkeypatch.context() as m:
        m.setattr(ps.proxy.renderer, "render", broken)
        msg = _anthropic_error(httpx.post(f"{ps.url}/v1/messages", json=ASK), 500, "api_error")
        assert "KeyError" in msg
        _openai_error(httpx.post(f"{ps.url}/v1/chat/completions", json=ASK), 500, "server_error")
    assert httpx.post(f"{ps.url}/v1/messages", json=ASK).status_code == 200
