"""Fuzzing the proxy's two APIs with hypothesis, against a real `gyre-proxy serve` process in front of a
real gyre-engine (the tiny model on the CPU).

Each hypothesis case is a seed naming a batch of requests sent at once (`batch`: plain generators;
drawing them through nested hypothesis strategies cost minutes): valid-ish conversations (which run on
the engine, streaming or not) and hostile ones (wrong types, unknown blocks and roles, broken tool pairs,
bodies that are not JSON, lone surrogates, deep nesting, odd headers, paths and methods), some from
clients that leave after a random moment. Every answer a client waits for is below 500 and, when it is
an error, in the API's JSON shape (in-band for a stream that started); every stream ends properly. After
each batch: the proxy process is alive, a good request is answered, and the engine has 0 rows generating
and the proxy 0 calls in flight (abandoned work was aborted). Request counts are in the test names."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from gyre_base.testing import free_port, until
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from .conftest import EngineProc, TinyEngines

pytestmark = [pytest.mark.fuzz, pytest.mark.slow]

BATCH = 24
A_ERRORS = {
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "request_too_large",
}
O_ERRORS = {"invalid_request_error", "permission_error"}


@dataclass
class FuzzTarget:
    url: str
    proc: subprocess.Popen[bytes]
    engine: EngineProc
    log: Path
    sent: int = 0

    def alive(self) -> None:
        assert self.proc.poll() is None, f"the proxy died ({self.proc.returncode}); see {self.log}"

    def settle(self) -> None:
        """A good request is answered; then nothing is left generating or in flight."""
        self.alive()
        r = httpx.post(f"{self.url}/v1/messages", json=GOOD, timeout=120)
        assert r.status_code == 200, r.text
        until(lambda: self.engine.rows() == 0, "the engine has nothing generating", 60)
        until(lambda: self.in_flight() == 0, "the proxy has no call in flight", 60)
        self.alive()

    def in_flight(self) -> int:
        st_ = httpx.get(f"{self.url}/gyre/stats", timeout=30).json()
        return sum(e["in_flight"] for e in st_["engines"])


STATUSES: dict[Any, int] = {}
GOOD = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def target(tiny_engines: TinyEngines, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzTarget]:
    engine = tiny_engines.procs[0]
    out = tmp_path_factory.mktemp("fuzz")
    port = free_port()
    log = out / "proxy.log"
    cmd = [sys.executable, "-m", "gyre_proxy.cli", "serve", "--tokenizer", str(tiny_engines.model)]
    cmd += ["--engine", engine.url, "--port", str(port), "--record-log", str(out / "records.msgpack")]
    cmd += ["--max-new-tokens-cap", "12", "--pick-wait", "30"]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
    t = FuzzTarget(f"http://127.0.0.1:{port}", proc, engine, log)
    try:
        until(lambda: _up(t), "gyre-proxy serve up", 120)
        yield t
    finally:
        proc.terminate()
        proc.wait(30)
    # uvicorn shuts down gracefully, then re-raises the SIGTERM it caught
    assert proc.returncode in (0, -signal.SIGTERM), f"the proxy did not stop cleanly; see {log}"
    assert b"Traceback" not in log.read_bytes(), f"the proxy logged a traceback; see {log}"


def _up(t: FuzzTarget) -> bool:
    t.alive()
    try:
        return httpx.get(f"{t.url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


# ------------------------------------------------------------------------------------ generators
# Each batch is drawn from one seed (the hypothesis case is the seed, printed when a batch fails) by plain
# `random.Random` generators that mirror what hypothesis's nested strategies drew: valid-ish bodies with
# any field of any JSON type, hostile text, unknown blocks and roles, broken tool pairs. Drawing 24
# nested requests through hypothesis cost most of this test's minutes; these cost milliseconds.

_ODD_TEXT = [
    "",
    " ",
    "\n",
    "\x00",
    "\u2028",
    "\ufeff",
    "é",
    "😀",
    "a\u0301",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
    '{"name": "x"}',
    "\\ud800",
    "null",
]


def _text(rnd: random.Random, max_size: int = 24) -> str:
    """Text as hypothesis's `st.text()` draws it (any code point but surrogates), with odd pieces."""
    out = []
    for _ in range(rnd.randint(0, max_size)):
        r = rnd.random()
        if r < 0.55:
            out.append(chr(rnd.randint(32, 126)))
        elif r < 0.7:
            out.append(rnd.choice(_ODD_TEXT))
        elif r < 0.85:
            out.append(chr(rnd.randint(0, 0x2FF)))
        else:
            c = rnd.randint(0, 0x10FFFF)
            out.append(chr(c) if not 0xD800 <= c <= 0xDFFF else "x")
    return "".join(out)[: max_size * 4]


def _any(rnd: random.Random, depth: int = 0) -> Any:
    """Any JSON value (and NaN / infinities, which are not JSON), nested up to 3 deep."""
    r = rnd.random()
    if r < 0.1:
        return None
    if r < 0.2:
        return rnd.random() < 0.5
    if r < 0.35:
        return rnd.choice([0, 1, -1, 2**31, 2**63, -(2**63) - 1, 10**30, rnd.randint(-1000, 1000)])
    if r < 0.45:
        return rnd.choice([0.0, -0.0, 1.5, 1e308, -1e-308, float("nan"), float("inf"), rnd.uniform(-9, 9)])
    if r < 0.7 or depth >= 3:
        return _text(rnd, 12)
    if r < 0.85:
        return [_any(rnd, depth + 1) for _ in range(rnd.randint(0, 3))]
    return {_text(rnd, 6): _any(rnd, depth + 1) for _ in range(rnd.randint(0, 3))}


class Draw(random.Random):
    """The generators' randomness; `clean` leaves out the any-type alternatives (more bodies run)."""

    clean = False


def _pick(rnd: random.Random, *choices: Any) -> Any:
    """One of `choices`, each a value or a function of `rnd` giving one."""
    if getattr(rnd, "clean", False):
        choices = tuple(c for c in choices if c is not _any) or choices
    c = rnd.choice(choices)
    return c(rnd) if callable(c) else c


def _maybe(rnd: random.Random, body: dict[str, Any], key: str, make: Any, p: float = 0.35) -> None:
    if rnd.random() < p:
        body[key] = make(rnd)


def _id(rnd: random.Random) -> str:
    return _pick(rnd, "t1", "t2", "toolu_x", "", lambda r: _text(r, 6))


def _turns(rnd: random.Random, block: Any) -> list[dict[str, Any]]:
    """Conversations: alternating user/assistant turns of plain text, or turns of any role and content."""
    if rnd.random() < 0.5:
        texts = [_text(rnd) or "x" for _ in range(rnd.randint(1, 3))]
        return [
            {"role": "user" if i % 2 == 0 else "assistant", "content": t}
            for i, t in enumerate(texts[: len(texts) // 2 * 2 + 1])
        ]
    roles = ("user", "assistant", "user", "assistant", "system", "tool", "bogus", "")
    return [
        {
            "role": _pick(rnd, *roles, _any),
            "content": _pick(rnd, _text, lambda r: [block(r) for _ in range(r.randint(0, 3))], _any),
        }
        for _ in range(rnd.randint(0, 4))
    ]


def _a_block(rnd: random.Random) -> Any:
    kind = rnd.randint(0, 3 if getattr(rnd, "clean", False) else 5)
    if kind == 0:
        return {"type": "text", "text": _text(rnd)}
    if kind == 1:
        return {"type": "tool_use", "id": _id(rnd), "name": _text(rnd), "input": _any(rnd)}
    if kind == 2:
        b: dict[str, Any] = {"type": "tool_result", "tool_use_id": _id(rnd)}
        _maybe(
            rnd,
            b,
            "content",
            lambda r: _pick(
                r, _text, lambda q: [{"type": "text", "text": _text(q)} for _ in range(q.randint(0, 2))]
            ),
            0.6,
        )
        _maybe(rnd, b, "is_error", lambda r: _pick(r, True, False, _any), 0.4)
        return b
    if kind == 3:
        return {"type": "thinking", "thinking": _text(rnd), "signature": _text(rnd)}
    if kind == 4:
        return {"type": rnd.choice(["image", "document", "redacted_thinking", "search_result", "nope", ""])}
    return _any(rnd)


def _anthropic_body(rnd: random.Random) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": _pick(rnd, "m", "m", "m", _any),
        "max_tokens": _pick(
            rnd, lambda r: r.randint(1, 12), lambda r: r.randint(1, 12), 0, -1, 10**6, 2**63, _any
        ),
        "messages": _turns(rnd, _a_block),
    }

    def tool(r: random.Random) -> dict[str, Any]:
        described = {"description": _text(r)} if r.random() < 0.5 else {}
        return {"name": _text(r), "input_schema": _any(r), **described}

    _maybe(
        rnd,
        body,
        "system",
        lambda r: _pick(r, _text, lambda q: [_a_block(q) for _ in range(q.randint(0, 2))], _any),
    )
    _maybe(rnd, body, "stream", lambda r: _pick(r, True, False, _any))
    _maybe(rnd, body, "temperature", lambda r: _pick(r, lambda q: q.uniform(0, 2), _any))
    _maybe(rnd, body, "top_p", lambda r: _pick(r, lambda q: q.uniform(0, 1), _any))
    _maybe(rnd, body, "top_k", lambda r: _pick(r, lambda q: q.randint(-2, 50), _any))
    _maybe(
        rnd,
        body,
        "stop_sequences",
        lambda r: _pick(r, lambda q: [_text(q) for _ in range(q.randint(0, 2))], _any),
    )
    _maybe(rnd, body, "tools", lambda r: _pick(r, lambda q: [tool(q) for _ in range(q.randint(0, 2))], _any))
    _maybe(rnd, body, "tool_choice", _any)
    _maybe(
        rnd,
        body,
        "thinking",
        lambda r: _pick(
            r,
            lambda q: {"type": q.choice(["enabled", "disabled"]), "budget_tokens": q.randint(-5, 10**6)},
            _any,
        ),
    )
    _maybe(rnd, body, "metadata", _any)
    _maybe(rnd, body, "cache_control", _any)
    return body


def _o_part(rnd: random.Random) -> Any:
    return _pick(
        rnd,
        lambda r: {"type": "text", "text": _text(r)},
        lambda r: {"type": r.choice(["image_url", "input_audio", "refusal", "file", "nope"])},
        _any,
    )


def _o_call(rnd: random.Random) -> dict[str, Any]:
    return {
        "id": _id(rnd),
        "type": _pick(rnd, "function", "function", _any),
        "function": {"name": _text(rnd), "arguments": _pick(rnd, "{}", _text, _any)},
    }


def _o_message(rnd: random.Random) -> Any:
    kind = rnd.randint(0, 3)
    if kind == 0:
        return {
            "role": rnd.choice(["system", "developer", "user"]),
            "content": _pick(rnd, _text, lambda r: [_o_part(r) for _ in range(r.randint(0, 2))]),
        }
    if kind == 1:
        m: dict[str, Any] = {"role": "assistant"}
        _maybe(rnd, m, "content", lambda r: _pick(r, _text, None), 0.6)
        _maybe(rnd, m, "tool_calls", lambda r: [_o_call(r) for _ in range(r.randint(0, 2))], 0.5)
        _maybe(rnd, m, "reasoning_content", _text, 0.3)
        return m
    if kind == 2:
        return {"role": "tool", "tool_call_id": _id(rnd), "content": _pick(rnd, _text, _any)}
    return {"role": _any(rnd), "content": _any(rnd)}


def _openai_body(rnd: random.Random) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": _pick(rnd, "m", "m", "m", _any),
        "messages": _pick(
            rnd,
            lambda r: [{"role": "user", "content": _text(r)} for _ in range(r.randint(1, 3))],
            lambda r: [_o_message(r) for _ in range(r.randint(0, 4))],
            _any,
        ),
    }

    def floats(lo: float, hi: float) -> Any:
        return lambda r: _pick(r, lambda q: q.uniform(lo, hi), _any)

    _maybe(rnd, body, "max_tokens", lambda r: _pick(r, lambda q: q.randint(1, 12), 0, -5, 10**9, _any))
    _maybe(rnd, body, "max_completion_tokens", lambda r: _pick(r, lambda q: q.randint(-1, 12), _any))
    _maybe(rnd, body, "stream", lambda r: _pick(r, True, False, _any))
    _maybe(
        rnd, body, "stream_options", lambda r: _pick(r, lambda q: {"include_usage": q.random() < 0.5}, _any)
    )
    _maybe(rnd, body, "temperature", floats(0, 2))
    _maybe(rnd, body, "top_p", floats(0, 1))
    _maybe(
        rnd,
        body,
        "stop",
        lambda r: _pick(r, _text, lambda q: [_text(q) for _ in range(q.randint(0, 3))], _any),
    )
    _maybe(rnd, body, "seed", lambda r: _pick(r, lambda q: q.randint(-(2**64), 2**64), _any))
    _maybe(rnd, body, "presence_penalty", floats(-3, 3))
    _maybe(rnd, body, "frequency_penalty", floats(-3, 3))
    _maybe(
        rnd,
        body,
        "logit_bias",
        lambda r: _pick(
            r,
            lambda q: {
                _pick(q, lambda z: str(z.randint(-5, 10**6)), _text): _pick(
                    q, lambda z: z.uniform(-200, 200), _any
                )
                for _ in range(q.randint(0, 3))
            },
            _any,
        ),
    )
    _maybe(rnd, body, "logprobs", lambda r: _pick(r, True, False, _any))
    _maybe(rnd, body, "top_logprobs", lambda r: _pick(r, lambda q: q.randint(-2, 25), _any))
    _maybe(rnd, body, "n", lambda r: _pick(r, lambda q: q.randint(0, 3), _any))
    _maybe(
        rnd,
        body,
        "response_format",
        lambda r: _pick(r, lambda q: {"type": q.choice(["text", "json_object", "json_schema"])}, _any),
    )
    _maybe(
        rnd,
        body,
        "tools",
        lambda r: _pick(
            r,
            lambda q: [
                {"type": "function", "function": {"name": _text(q), "parameters": _any(q)}}
                for _ in range(q.randint(0, 2))
            ],
            _any,
        ),
    )
    _maybe(rnd, body, "tool_choice", lambda r: _pick(r, "auto", _any))
    _maybe(rnd, body, "parallel_tool_calls", lambda r: _pick(r, True, False, _any))
    _maybe(rnd, body, "reasoning_effort", lambda r: _pick(r, "none", "minimal", "low", "high", "bogus", _any))
    _maybe(rnd, body, "user", _any)
    _maybe(rnd, body, "unknown_field", _any)
    return body


def _encode(obj: Any, rnd: random.Random) -> bytes:
    """JSON, with NaN/Infinity where the body has them (not JSON), non-ASCII escaped or not."""
    text = json.dumps(obj, allow_nan=True, ensure_ascii=rnd.random() < 0.5)
    return text.encode("utf-8", "surrogatepass")


_HOSTILE_RAW = [
    b"",
    b"{",
    b"null",
    b"[]",
    b'{"messages": [{"role": "user", "content": "\\ud800"}], "model": "m", "max_tokens": 3}',
    b'{"messages": [{"role": "user", "content": "\xff\xfe"}], "model": "m", "max_tokens": 3}',
    b"[" * 100000 + b"]" * 100000,
    b'{"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "'
    + b"a" * 2_000_000
    + b'"}]}',
]


def _hostile_raw(rnd: random.Random) -> bytes:
    if rnd.random() < 0.5:
        return rnd.randbytes(rnd.randint(0, 64))
    return rnd.choice(_HOSTILE_RAW)


@dataclass
class Req:
    method: str
    path: str
    body: bytes
    headers: dict[str, str]
    leave_after: float | None  # the client disconnects after this many seconds; None: waits
    api: str

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # hypothesis prints failing cases with this
        p.text(repr(self))

    def __repr__(self) -> str:
        # hypothesis prints failing cases; a deep-nesting body would make that repr hundreds of kB
        body = self.body if len(self.body) <= 400 else self.body[:400] + b"...(%d bytes)" % len(self.body)
        return (
            f"Req({self.method} {self.path!r}, body={body!r}, headers={self.headers!r}, "
            f"leave_after={self.leave_after}, api={self.api})"
        )


_HEADERS = {
    "content-type": lambda r: r.choice(
        ["application/json", "text/plain", "application/x-www-form-urlencoded", ""]
    ),
    "x-api-key": None,
    "authorization": None,
    "anthropic-beta": None,
    "anthropic-version": None,
    "x-claude-code-session-id": None,
    "x-claude-code-agent-id": None,
    "x-gyre-agent": None,
    "x-gyre-execution": None,
    "x-gyre-role": None,
}


def _headers(rnd: random.Random) -> dict[str, str]:
    """Each header or not, with printable values (h11's rules)."""
    out: dict[str, str] = {}
    for name, make in _HEADERS.items():
        if rnd.random() < 0.3:
            value = "".join(chr(rnd.randint(32, 126)) for _ in range(rnd.randint(1, 16))).strip() or "x"
            out[name] = make(rnd) if make else (f"Bearer {value}" if name == "authorization" else value)
    return out


_A_ROUTES = [("POST", "/v1/messages")] * 6 + [
    ("POST", "/v1/messages?beta=true"),
    ("POST", "/v1/messages/count_tokens"),
    ("GET", "/v1/models"),
    ("GET", "/v1/messages"),
    ("PUT", "/v1/messages"),
    ("POST", "/v1/messagez"),
]
_O_ROUTES = [("POST", "/v1/chat/completions")] * 8 + [
    ("GET", "/v1/chat/completions"),
    ("POST", "/v1/chat/completion"),
    ("DELETE", "/v1/chat/completions"),
]


def request(api: str, rnd: Draw) -> Req:
    """One request to `api`'s routes: a body as above (or a hostile raw one, 1 in 4), headers, a route
    (and an `/e/{execution}` prefix, 1 in 2), and a client that leaves after a moment (1 in 4)."""
    raw = _hostile_raw(rnd) if rnd.random() < 0.25 else None
    assert isinstance(rnd, Draw)
    rnd.clean = rnd.random() < 0.35  # a third of the bodies keep every field's type (more of them run)
    make = _anthropic_body if api == "anthropic" else _openai_body
    body = raw if raw is not None else _encode(make(rnd), rnd)
    rnd.clean = False
    method, path = rnd.choice(_A_ROUTES if api == "anthropic" else _O_ROUTES)
    if rnd.random() < 0.5:
        path = "/e/" + quote(_text(rnd, 10) or "x", safe="") + path
    leave = rnd.uniform(0.0, 0.4) if rnd.random() < 0.25 else None
    return Req(method, path, body, _headers(rnd), leave, api)


def batch(api: str, seed: int) -> list[Req]:
    """The batch of `BATCH` requests that `seed` names."""
    rnd = Draw(seed)
    return [request(api, rnd) for _ in range(BATCH)]


# ------------------------------------------------------------------------------------ checks


def _check_error(api: str, status: int, data: dict[str, Any], text: str) -> None:
    if api == "anthropic":
        assert data.get("type") == "error", text
        assert data["error"]["type"] in A_ERRORS and isinstance(data["error"]["message"], str), text
    else:
        err = data["error"]
        assert err["type"] in O_ERRORS and isinstance(err["message"], str), text
        assert set(err) == {"message", "type", "param", "code"}, text


def _check_stream(api: str, text: str) -> None:
    # split at LF only: a model's text may hold U+2028 and the like (see gyre_engine.sse)
    datas = [line[5:].strip() for line in text.split("\n") if line.startswith("data:")]
    assert datas, text
    if api == "anthropic":
        last = json.loads(datas[-1])
        if last["type"] == "error":
            assert last["error"]["type"] in A_ERRORS, text  # in-band, but a client error
        else:
            assert last["type"] == "message_stop", text
    else:
        assert datas[-1] == "[DONE]" or json.loads(datas[-1])["error"]["type"] in O_ERRORS, text


async def _send(client: httpx.AsyncClient, url: str, req: Req) -> None:
    if req.leave_after is not None:
        await _leave(url, req)
        return
    r = await client.request(req.method, f"{url}{req.path}", content=req.body, headers=req.headers)
    key = (r.status_code, r.headers.get("content-type", "")[:12])
    STATUSES[key] = STATUSES.get(key, 0) + 1
    assert r.status_code < 500, (req.path, req.body[:300], r.status_code, r.text[:500])
    api = "openai" if "/chat/" in req.path else "anthropic"
    ctype = r.headers.get("content-type", "")
    if ctype.startswith("text/event-stream"):
        assert r.status_code == 200
        _check_stream(api, r.text)
        return
    data = r.json()
    if r.status_code >= 400:
        _check_error(api, r.status_code, data, r.text[:500])


async def _leave(url: str, req: Req) -> None:
    """A raw HTTP/1.1 client that disconnects after `leave_after` seconds, answered or not."""
    host, port = url.removeprefix("http://").split(":")
    _reader, writer = await asyncio.open_connection(host, int(port))
    try:
        head = f"{req.method} {req.path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(req.body)}\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in req.headers.items())
        writer.write(head.encode("latin-1") + b"\r\n" + req.body)
        await writer.drain()
        assert req.leave_after is not None
        await asyncio.sleep(req.leave_after)
    finally:  # also when the batch failed elsewhere and this task is cancelled: no socket left to the GC
        writer.close()
    await writer.wait_closed()


async def _batch(url: str, reqs: list[Req]) -> None:
    limits = httpx.Limits(max_connections=BATCH)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        await asyncio.gather(*(_send(client, url, r) for r in reqs))


def _fuzz(target: FuzzTarget, reqs: list[Req]) -> None:
    target.sent += len(reqs)
    asyncio.run(_batch(target.url, reqs))
    target.settle()


BATCHES = 16
"""Batches in the default run (384 requests per API); the `long` run sends 50 (1,200)."""
LONG_BATCHES = 50


def _settings(batches: int) -> settings:
    return settings(
        max_examples=batches,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.generate],
    )


def _run(target: FuzzTarget, api: str, batches: int) -> None:
    @_settings(batches)
    @given(st.integers(0, 2**64 - 1))
    def one(seed: int) -> None:
        _fuzz(target, batch(api, seed))

    before = target.sent
    one()
    assert target.sent - before == batches * BATCH
    print(f"\nanswers by (status, content type): {STATUSES}")


def test_anthropic_api_fuzz_384_requests(target: FuzzTarget) -> None:
    """16 batches of 24 requests to the Anthropic routes."""
    _run(target, "anthropic", BATCHES)


def test_openai_api_fuzz_384_requests(target: FuzzTarget) -> None:
    """16 batches of 24 requests to the OpenAI route."""
    _run(target, "openai", BATCHES)


@pytest.mark.long
def test_anthropic_api_fuzz_1200_requests(target: FuzzTarget) -> None:
    """50 batches of 24 requests to the Anthropic routes."""
    _run(target, "anthropic", LONG_BATCHES)


@pytest.mark.long
def test_openai_api_fuzz_1200_requests(target: FuzzTarget) -> None:
    """50 batches of 24 requests to the OpenAI route."""
    _run(target, "openai", LONG_BATCHES)
