"""Fuzzing the proxy's two APIs with hypothesis, against a real `gyre-proxy serve` process in front of a
real gyre-engine (the tiny model on the CPU).

Each hypothesis case is a batch of requests sent at once: valid-ish conversations (which run on the
engine, streaming or not) and hostile ones (wrong types, unknown blocks and roles, broken tool pairs,
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
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from .conftest import EngineProc, TinyEngines, free_port, wait_until

# A case's 24 bodies can hold deep nesting: hypothesis warns that their repr is large (it is, and it is
# only printed when the case fails, shortened by Req.__repr__).
pytestmark = [
    pytest.mark.fuzz,
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:Generating overly large repr:hypothesis.errors.HypothesisWarning"),
]

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
        wait_until(lambda: self.engine.rows() == 0, "the engine has nothing generating", 60)
        wait_until(lambda: self.in_flight() == 0, "the proxy has no call in flight", 60)
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
        wait_until(lambda: _up(t), "gyre-proxy serve up", 120)
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


# ------------------------------------------------------------------------------------ strategies

_printable = st.characters(min_codepoint=32, max_codepoint=126)
_text = st.text(max_size=24)
_any = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
_ids = st.sampled_from(["t1", "t2", "toolu_x", ""]) | st.text(max_size=6)


def _turns(blocks: st.SearchStrategy[Any]) -> st.SearchStrategy[list[dict[str, Any]]]:
    """Conversations: alternating user/assistant turns (mostly), content as text or blocks."""
    turn = st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant"])
            | st.sampled_from(["system", "tool", "bogus", ""])
            | _any,
            "content": _text | st.lists(blocks, max_size=3) | _any,
        }
    )
    plain = st.lists(_text, min_size=1, max_size=3).map(
        lambda texts: [
            {"role": "user" if i % 2 == 0 else "assistant", "content": t or "x"}
            for i, t in enumerate(texts[: len(texts) // 2 * 2 + 1])
        ]
    )
    return plain | st.lists(turn, max_size=4)


_a_block = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": _text}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": _ids, "name": _text, "input": _any}),
    st.fixed_dictionaries(
        {"type": st.just("tool_result"), "tool_use_id": _ids},
        optional={
            "content": _text | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _text})),
            "is_error": st.booleans() | _any,
        },
    ),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": _text, "signature": _text}),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["image", "document", "redacted_thinking", "search_result", "nope", ""])}
    ),
    _any,
)
_a_tool = st.fixed_dictionaries({"name": _text, "input_schema": _any}, optional={"description": _text})
_anthropic_body = st.fixed_dictionaries(
    {
        "model": st.just("m") | _any,
        "max_tokens": st.integers(1, 12) | st.sampled_from([0, -1, 10**6, 2**63]) | _any,
        "messages": _turns(_a_block),
    },
    optional={
        "system": _text | st.lists(_a_block, max_size=2) | _any,
        "stream": st.booleans() | _any,
        "temperature": st.floats(0, 2) | st.floats() | _any,
        "top_p": st.floats(0, 1) | _any,
        "top_k": st.integers(-2, 50) | _any,
        "stop_sequences": st.lists(_text, max_size=2) | _any,
        "tools": st.lists(_a_tool, max_size=2) | _any,
        "tool_choice": _any,
        "thinking": st.fixed_dictionaries(
            {"type": st.sampled_from(["enabled", "disabled"]), "budget_tokens": st.integers()}
        )
        | _any,
        "metadata": _any,
        "cache_control": _any,
    },
)

_o_part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": _text}),
    st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio", "refusal", "file", "nope"])}),
    _any,
)
_o_call = st.fixed_dictionaries(
    {
        "id": _ids,
        "type": st.just("function") | _any,
        "function": st.fixed_dictionaries({"name": _text, "arguments": st.just("{}") | _text | _any}),
    }
)
_o_message = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "developer", "user"]),
            "content": _text | st.lists(_o_part, max_size=2),
        }
    ),
    st.fixed_dictionaries(
        {"role": st.just("assistant")},
        optional={
            "content": _text | st.none(),
            "tool_calls": st.lists(_o_call, max_size=2),
            "reasoning_content": _text,
        },
    ),
    st.fixed_dictionaries({"role": st.just("tool"), "tool_call_id": _ids, "content": _text | _any}),
    st.fixed_dictionaries({"role": _any, "content": _any}),
)
_openai_body = st.fixed_dictionaries(
    {
        "model": st.just("m") | _any,
        "messages": st.lists(_text, min_size=1, max_size=3).map(
            lambda ts: [{"role": "user", "content": t} for t in ts]
        )
        | st.lists(_o_message, max_size=4)
        | _any,
    },
    optional={
        "max_tokens": st.integers(1, 12) | st.sampled_from([0, -5, 10**9]) | _any,
        "max_completion_tokens": st.integers(-1, 12) | _any,
        "stream": st.booleans() | _any,
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | _any,
        "temperature": st.floats(0, 2) | st.floats() | _any,
        "top_p": st.floats(0, 1) | _any,
        "stop": _text | st.lists(_text, max_size=3) | _any,
        "seed": st.integers() | _any,
        "presence_penalty": st.floats(-3, 3) | _any,
        "frequency_penalty": st.floats(-3, 3) | _any,
        "logit_bias": st.dictionaries(
            st.integers(-5, 10**6).map(str) | _text, st.floats(-200, 200) | _any, max_size=3
        )
        | _any,
        "logprobs": st.booleans() | _any,
        "top_logprobs": st.integers(-2, 25) | _any,
        "n": st.integers(0, 3) | _any,
        "response_format": st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "json_object", "json_schema"])}
        )
        | _any,
        "tools": st.lists(
            st.fixed_dictionaries(
                {
                    "type": st.just("function"),
                    "function": st.fixed_dictionaries({"name": _text, "parameters": _any}),
                }
            ),
            max_size=2,
        )
        | _any,
        "tool_choice": st.just("auto") | _any,
        "parallel_tool_calls": st.booleans() | _any,
        "reasoning_effort": st.sampled_from(["none", "minimal", "low", "high", "bogus"]) | _any,
        "user": _any,
        "unknown_field": _any,
    },
)


def _encode(obj: Any, rnd: random.Random) -> bytes:
    """JSON, with NaN/Infinity where the body has them (not JSON), non-ASCII escaped or not."""
    text = json.dumps(obj, allow_nan=True, ensure_ascii=rnd.random() < 0.5)
    return text.encode("utf-8", "surrogatepass")


_hostile_raw = st.one_of(
    st.binary(max_size=64),
    st.sampled_from(
        [
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
    ),
)


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


def _headers() -> st.SearchStrategy[dict[str, str]]:
    value = st.text(_printable, min_size=1, max_size=16).map(lambda v: v.strip() or "x")  # h11's rules
    return st.fixed_dictionaries(
        {},
        optional={
            "content-type": st.sampled_from(
                ["application/json", "text/plain", "application/x-www-form-urlencoded", ""]
            ),
            "x-api-key": value,
            "authorization": value.map(lambda v: f"Bearer {v}"),
            "anthropic-beta": value,
            "anthropic-version": value,
            "x-claude-code-session-id": value,
            "x-claude-code-agent-id": value,
            "x-gyre-agent": value,
            "x-gyre-execution": value,
            "x-gyre-role": value,
        },
    )


@st.composite
def requests(draw: st.DrawFn, api: str) -> Req:
    rnd = random.Random(draw(st.integers(0, 2**32)))
    body_obj = draw(_anthropic_body if api == "anthropic" else _openai_body)
    raw = draw(st.one_of(st.none(), st.none(), st.none(), _hostile_raw))
    body = raw if raw is not None else _encode(body_obj, rnd)
    if api == "anthropic":
        route = draw(
            st.sampled_from(
                [("POST", "/v1/messages")] * 6
                + [
                    ("POST", "/v1/messages?beta=true"),
                    ("POST", "/v1/messages/count_tokens"),
                    ("GET", "/v1/models"),
                    ("GET", "/v1/messages"),
                    ("PUT", "/v1/messages"),
                    ("POST", "/v1/messagez"),
                ]
            )
        )
    else:
        route = draw(
            st.sampled_from(
                [("POST", "/v1/chat/completions")] * 8
                + [
                    ("GET", "/v1/chat/completions"),
                    ("POST", "/v1/chat/completion"),
                    ("DELETE", "/v1/chat/completions"),
                ]
            )
        )
    method, path = route
    if draw(st.booleans()):
        path = "/e/" + quote(draw(st.text(min_size=1, max_size=10)), safe="") + path
    leave = draw(st.none() | st.none() | st.none() | st.floats(0.0, 0.4))
    return Req(method, path, body, draw(_headers()), leave, api)


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


BATCHES = 50
FUZZ = settings(
    max_examples=BATCHES,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.generate],
)


@FUZZ
@given(st.lists(requests("anthropic"), min_size=BATCH, max_size=BATCH))
def _anthropic(target: FuzzTarget, reqs: list[Req]) -> None:
    _fuzz(target, reqs)


@FUZZ
@given(st.lists(requests("openai"), min_size=BATCH, max_size=BATCH))
def _openai(target: FuzzTarget, reqs: list[Req]) -> None:
    _fuzz(target, reqs)


@pytest.mark.timeout(1500)  # hypothesis drawing the nested cases takes most of it (5-7 min here)
def test_anthropic_api_fuzz_1200_requests(target: FuzzTarget) -> None:
    """50 batches of 24 requests to the Anthropic routes."""
    before = target.sent
    _anthropic(target)
    assert target.sent - before == BATCHES * BATCH == 1200
    print(f"\nanswers by (status, content type): {STATUSES}")


@pytest.mark.timeout(1500)  # hypothesis drawing the nested cases takes most of it (5-7 min here)
def test_openai_api_fuzz_1200_requests(target: FuzzTarget) -> None:
    """50 batches of 24 requests to the OpenAI route."""
    before = target.sent
    _openai(target)
    assert target.sent - before == BATCHES * BATCH == 1200
    print(f"\nanswers by (status, content type): {STATUSES}")
