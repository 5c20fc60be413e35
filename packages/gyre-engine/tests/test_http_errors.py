"""Bad HTTP traffic against a real server subprocess: every error in the shape SGLang 0.5.23
answers it (compared with its recorded replies), bodies bounded by a configurable size (413), and a huge
`text` that neither stalls other requests nor is tokenized when it cannot fit the context."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from gyre_engine.client import EngineClient
from gyre_engine.protocol import SamplingParams

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent))  # the shared helpers (tests run with --import-mode=importlib)
from sglang_shapes import fixture  # noqa: E402

USER = [1200 + i * 7 for i in range(9)]
MIB = 1 << 20


@pytest.fixture(scope="module")
def small_bodies(spawn_server: Any) -> Any:
    """A server whose bodies are bounded at 1 MiB (bulk paths: 3 MiB)."""
    return spawn_server("--max-body-mb", "1", "--max-bulk-body-mb", "3")


def _good(url: str) -> None:
    async def go() -> None:
        async with EngineClient(url, timeout_s=60) as c:
            r = await c.generate(USER, SamplingParams(max_new_tokens=2))
            assert r.meta_info.completion_tokens == 2

    asyncio.run(go())


@pytest.mark.parametrize(
    ("method", "path", "recorded"),
    [
        ("POST", "/no_such_route", "unknown_route"),
        ("GET", "/no_such_route", "unknown_route_get"),
        ("GET", "/generate", "wrong_method_generate"),
        ("POST", "/model_info", "wrong_method_model_info"),
    ],
)
def test_unknown_paths_and_wrong_methods_answer_as_sglang(
    server: Any, method: str, path: str, recorded: str
) -> None:
    theirs = fixture(recorded)
    r = httpx.request(method, f"{server.url}{path}", json={} if method == "POST" else None, timeout=30)
    assert r.status_code == theirs["status"]
    assert r.headers["content-type"] == theirs["content_type"] == "application/json"
    assert r.json() == theirs["body"]
    if r.status_code == 405:
        assert method not in r.headers["allow"]


@pytest.mark.parametrize(
    ("raw", "recorded"),
    [(b'{"input_ids": [1, 2', "error_malformed_json"), (b'{"input_ids": "no"}', "error_wrong_type")],
)
def test_bodies_that_do_not_fit_the_schema_answer_in_sglangs_shape(
    server: Any, raw: bytes, recorded: str
) -> None:
    theirs = fixture(recorded)["body"]
    r = httpx.post(f"{server.url}/generate", content=raw, timeout=30)
    assert r.status_code == 400
    ours = r.json()
    assert set(ours) == set(theirs) and {k: ours[k] for k in ("object", "type", "param", "code")} == {
        k: theirs[k] for k in ("object", "type", "param", "code")
    }
    assert ours["message"]


def test_bodies_over_the_limit_are_413_declared_or_streamed(small_bodies: Any) -> None:
    url = small_bodies.url
    big = b'{"input_ids": [' + b"1," * MIB + b"1]}"
    r = httpx.post(f"{url}/generate", content=big, timeout=60)
    assert r.status_code == 413
    err = r.json()["error"]
    assert err["code"] == 413 and err["type"] == "PayloadTooLarge" and "--max-body-mb" in err["message"]

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 64 << 10):
            yield big[i : i + (64 << 10)]

    async def streamed() -> httpx.Response:
        async with httpx.AsyncClient(timeout=60) as h:
            return await h.post(f"{url}/generate", content=chunked())

    r = asyncio.run(streamed())
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    # the bulk paths take bodies past the default bound (this one is not a KvPrefix: 400, not 413)
    r = httpx.post(f"{url}/import_prefix", content=b"\x00" * (2 * MIB), timeout=60)
    assert r.status_code == 400
    r = httpx.post(f"{url}/import_prefix", content=b"\x00" * (4 * MIB), timeout=60)
    assert r.status_code == 413 and "--max-bulk-body-mb" in r.json()["error"]["message"]
    _good(url)


def test_a_10_mb_text_is_refused_without_being_tokenized(server: Any) -> None:
    """Its length in bytes already rules it out (before the fix: tokenized on the event loop first,
    which stalled every request; the message then counted its tokens exactly)."""
    text = "the quick brown fox jumps over the lazy dog. " * (10_000_000 // 45)
    r = httpx.post(f"{server.url}/generate", json={"text": text}, timeout=120)
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "bytes of text" in msg and "longer than the model's context length (40960 tokens)" in msg
    _good(server.url)


def test_other_requests_are_answered_while_a_long_text_is_tokenized(server: Any) -> None:
    """A 2 MB text may fit the context as far as its bytes tell, so it is tokenized (seconds of work
    here) and then refused; requests sent meanwhile are answered before it (before the fix the event loop
    tokenized it and answered nothing until it was done)."""
    text = "gyre " * 400_000
    done: list[str] = []

    async def long_text(h: httpx.AsyncClient) -> None:
        r = await h.post(f"{server.url}/generate", json={"text": text})
        assert r.status_code == 400 and "tokens) is longer than" in r.json()["error"]["message"]
        done.append("long text")

    async def go() -> None:
        async with httpx.AsyncClient(timeout=300) as h, EngineClient(server.url, timeout_s=300) as c:
            task = asyncio.create_task(long_text(h))
            await asyncio.sleep(1.0)  # the text has arrived and is being tokenized
            for _ in range(3):
                r = await c.generate(USER, SamplingParams(max_new_tokens=1))
                assert r.meta_info.completion_tokens == 1
                done.append("short")
            await task

    asyncio.run(go())
    assert done == ["short", "short", "short", "long text"]


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        # found by fuzzing: a path too long for the file system was an OSError, a 500
        ("/update_weights_from_disk", {"model_path": "ab\u00e9 " * 2500}, "cannot read the weights"),
        # found by fuzzing: a publisher ZeroMQ cannot connect to was a ZMQError, a 500
        ("/update_weights_from_xfer", {"publisher": "not an address", "transport": "shm"}, "publisher"),
    ],
)
def test_a_body_naming_what_cannot_be_opened_is_a_400(
    server: Any, path: str, body: dict[str, Any], needle: str
) -> None:
    r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    _good(server.url)


def test_a_client_gone_before_its_body_arrived_is_a_499() -> None:
    """Starlette raises ClientDisconnect when a client leaves while its body is read (found by fuzzing:
    a 500 and a logged traceback); nobody reads the answer, but it is not the server's fault."""
    from gyre_engine.server.errors import error_for
    from starlette.requests import ClientDisconnect

    r = error_for(ClientDisconnect())
    assert r.status_code == 499 and b"ClientClosedRequest" in r.body
