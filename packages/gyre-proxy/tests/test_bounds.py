"""What one request may cost the proxy: a body over `max_body_bytes` is refused with a 413 in the API's
shape before it is parsed, as soon as its `Content-Length` or its bytes pass the bound (a chunked body is
not read to its end); text that cannot fit the context is refused before it is tokenized; and the work
that grows with a request (decoding, rendering, tokenizing) runs on the proxy's worker thread, not on
its event loop, for any request larger than `INLINE_BYTES`."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from gyre_proxy.chat import Conversation, Kind, Turn
from gyre_proxy.core import INLINE_BYTES
from gyre_proxy.render import ContextTooLong, ExecutionCache, Renderer
from gyre_traj.io import read_records
from tokenizers import Tokenizer

BOUND = 64 * 1024


def _raw_chunked(port: int, path: str, total: int) -> tuple[int, bytes]:
    """POST `total` bytes of a chunked body that never ends, then read the answer: (status, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        piece = b"a" * 4096
        for _ in range(total // len(piece)):
            s.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n")
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += s.recv(65536)
        head, _, rest = answer.partition(b"\r\n\r\n")
        length = next(
            int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")
        )
        while len(rest) < length:
            rest += s.recv(65536)
        return int(head.split(b" ", 2)[1]), rest[:length]


@pytest.mark.parametrize("api", ["anthropic", "openai"])
def test_a_body_over_the_bound_is_refused_before_it_is_read_whole(
    engine: Any, make_proxy: Any, api: str
) -> None:
    ps = make_proxy([engine.url], max_body_bytes=BOUND)
    path = "/v1/messages" if api == "anthropic" else "/v1/chat/completions"
    # declared too long: refused at once
    r = httpx.post(f"{ps.url}{path}", content=b"{" * (BOUND + 1))
    assert r.status_code == 413, r.text
    body = r.json()
    if api == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "request_too_large"
    else:
        assert body["error"]["type"] == "invalid_request_error" and set(body["error"]) == {
            "message",
            "type",
            "param",
            "code",
        }
    assert "max_body_bytes" in r.text
    # chunked, no length, past the bound and never finished: refused without the rest
    status, answer = _raw_chunked(ps.server.port, path, 4 * BOUND)
    assert status == 413, answer
    # a body within the bound still works
    ok = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(f"{ps.url}{path}", json=ok).status_code == 200
    assert len(engine.seen) == 1
    assert len(list(read_records(ps.log_path))) == 1


class CountingTokenizer:
    """The real tokenizer, counting the characters it was asked to encode."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.chars = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> Any:
        self.chars += len(text)
        return self.tok.encode(text, add_special_tokens=add_special_tokens)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tok, name)


def test_text_that_cannot_fit_the_context_is_not_tokenized(tokenizer: Tokenizer) -> None:
    counting = CountingTokenizer(tokenizer)
    r = Renderer(counting)  # type: ignore[arg-type]
    huge = "x" * 5_000_000
    conv = Conversation("sys", (), (Turn(Kind.USER, "hi"), Turn(Kind.USER, huge)))
    with pytest.raises(ContextTooLong) as e:
        r.render(conv, ExecutionCache(), "main", limit=40960)
    assert "at least" in str(e.value) and e.value.limit == 40960
    assert counting.chars < 100  # the header and the first turn, not the 5 MB
    with pytest.raises(ContextTooLong):
        r.render_full(conv, limit=40960)
    # within the context it renders as before (the bound is a lower bound: never a false refusal)
    small = Conversation("sys", (), (Turn(Kind.USER, "word " * 2000),))
    done, _ = r.render(small, ExecutionCache(), "main", limit=40960)
    assert done.n_tokens == len(r.encode(r.full_text(small)))
    assert np.array_equal(done.ids(), r.encode(r.full_text(small)))


def test_decoding_and_rendering_of_a_large_request_run_off_the_event_loop(
    engine: Any, make_proxy: Any
) -> None:
    """A request over `INLINE_BYTES` is decoded, rendered and recorded on the proxy's worker thread; a
    small one (bounded work) may be handled on the event loop's thread."""
    ps = make_proxy([engine.url])
    proxy = ps.proxy
    threads: list[str] = []
    render = proxy.renderer.render

    def spy(*a: Any, **kw: Any) -> Any:
        threads.append(threading.current_thread().name)
        return render(*a, **kw)

    proxy.renderer.render = spy  # type: ignore[method-assign]
    text = "word " * (INLINE_BYTES // 4)
    big = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": text}]}
    for path in ("/v1/messages", "/v1/chat/completions", "/v1/messages/count_tokens"):
        r = httpx.post(f"{ps.url}{path}", json=big)
        assert r.status_code == 200, r.text
    assert len(threads) == 3 and all(t.startswith("gyre-proxy-worker") for t in threads), threads
    small = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(f"{ps.url}/v1/messages", json=small).status_code == 200
    assert len(threads) == 4
    assert Path(ps.log_path).exists()


def test_messages_seen_before_are_decoded_once_with_the_same_result() -> None:
    """The decoded-message cache changes nothing but the cost: the request and conversation equal the plain
    decode's, a request that repeats the history decodes only its new messages, and a bad message is named
    as the plain decode names it, whether or not its neighbours were seen before."""
    from gyre_proxy import anthropic_request as AR
    from gyre_proxy.chat import RequestError
    from gyre_proxy.msgcache import MessageCache
    from gyre_proxy.strip import Stripper

    stripper = Stripper(())
    cache = MessageCache(1 << 20)
    tool = {"type": "tool_use", "id": "t1", "name": "bash", "input": {"command": "ls"}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "a.txt"}
    msgs: list[dict[str, Any]] = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}, tool]},
        {"role": "user", "content": [result]},
        {"role": "system", "content": []},
    ]
    for n in range(1, len(msgs) + 1):
        body = json.dumps({"model": "m", "max_tokens": 5, "system": "s", "messages": msgs[:n]}).encode()
        req, conv, _ = AR.decode_conversation(body, stripper, cache)
        want = AR.decode(body)
        assert isinstance(want, AR.ARequest)
        assert req == want and conv == AR.to_conversation(want, stripper)
    assert cache.hits >= 4 and len(cache) == len(msgs)
    bad = [*msgs, {"role": "user", "content": [{"type": "pictogram"}]}]
    body = json.dumps({"model": "m", "max_tokens": 5, "messages": bad}).encode()
    with pytest.raises(RequestError) as e:
        AR.decode_conversation(body, stripper, cache)
    assert e.value.field == "messages.4.content.0.type"
    typed = [*msgs, {"role": 5, "content": "x"}]
    body = json.dumps({"model": "m", "max_tokens": 5, "messages": typed}).encode()
    with pytest.raises(RequestError) as e:
        AR.decode_conversation(body, stripper, cache)
    with pytest.raises(RequestError) as plain:
        AR.decode(body)
    assert (e.value.field, str(e.value)) == (plain.value.field, str(plain.value))
