"""The engine-stream client over real loopback HTTP: chunked bodies (from uvicorn, as SGLang and
gyre-engine stream), Content-Length bodies and bodies ended by the connection's close, all read whole;
kept-alive connections reused, a closed one dropped before use, one left mid-body closed rather than
reused; a server that answers nothing, resets or is silent fails with httpx's transport errors."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import httpx
import pytest
from gyre_base.testing import AppThread, free_port
from gyre_proxy.upstream import UpstreamClient
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route


def run[**P](fn: Callable[P, Coroutine[Any, Any, None]]) -> Callable[P, None]:
    """A test written as a coroutine, run on its own event loop."""

    @functools.wraps(fn)
    def test(*args: P.args, **kwargs: P.kwargs) -> None:
        asyncio.run(fn(*args, **kwargs))

    return test


async def _read_request(r: asyncio.StreamReader) -> bytes:
    head = await r.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    return head + await r.readexactly(length)


class RawServer:
    """A TCP server on loopback sending exactly the bytes a test gives; counts connections and requests."""

    def __init__(self, answer: Callable[[int], bytes | None], close_after: bool = False) -> None:
        self.answer = answer  # request number -> response bytes (None: close without answering)
        self.close_after = close_after
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None
        self.handlers: set[asyncio.Task[None]] = set()
        self.url = ""

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/generate"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for t in self.handlers:
            t.cancel()
        await asyncio.gather(*self.handlers, return_exceptions=True)
        await self.server.wait_closed()

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        try:
            while True:
                try:
                    req = await _read_request(r)
                except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
                    return
                n = len(self.requests)
                self.requests.append(req)
                out = self.answer(n)
                if out is None:
                    return
                w.write(out)
                await w.drain()
                if self.close_after:
                    return
        finally:
            w.close()


def _chunked(pieces: list[bytes]) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    return b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n" + body


def _sized(body: bytes, status: int = 200) -> bytes:
    return b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n\r\n%s" % (status, len(body), body)


async def _post(c: UpstreamClient, url: str, body: bytes = b'{"a":1}') -> tuple[int, bytes]:
    async with c.stream(url, body, {"content-type": "application/json", "authorization": "Bearer t"}) as r:
        return r.status_code, await r.aread()


SSE = [b'data: {"x":1}\n\n', b'data: {"x":2}\n\n', b"data: [DONE]\n\n"]


@run
async def test_chunked_sized_and_close_delimited_bodies_on_one_kept_connection() -> None:
    answers = [_chunked(SSE), _sized(b"".join(SSE)), _sized(b"bad", 503)]
    async with RawServer(lambda n: answers[n]) as srv, UpstreamClient() as c:
        for want_status, want in [(200, b"".join(SSE)), (200, b"".join(SSE)), (503, b"bad")]:
            assert await _post(c, srv.url) == (want_status, want)
        assert srv.connections == 1  # each response read whole: the connection went back and was reused
        head, _, body = srv.requests[0].partition(b"\r\n\r\n")
        assert head.startswith(b"POST /generate HTTP/1.1\r\n")
        assert b"authorization: Bearer t" in head and b"content-length: 7" in head
        assert body == b'{"a":1}'
    close_delimited = b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n" + b"".join(SSE)
    async with RawServer(lambda n: close_delimited, close_after=True) as srv, UpstreamClient() as c:
        assert await _post(c, srv.url) == (200, b"".join(SSE))
        assert await _post(c, srv.url) == (200, b"".join(SSE))
        assert srv.connections == 2 and c.idle_connections == 0


@run
async def test_a_connection_the_server_closed_is_not_reused() -> None:
    async with RawServer(lambda n: _sized(b"ok"), close_after=True) as srv, UpstreamClient() as c:
        for _ in range(3):
            await asyncio.sleep(0.05)  # the server's close arrives while the connection is idle
            assert await _post(c, srv.url) == (200, b"ok")
        assert srv.connections == 3


@run
async def test_no_answer_reset_silence_and_refused_are_transport_errors() -> None:
    async with RawServer(lambda n: None) as srv, UpstreamClient() as c:
        with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
            await _post(c, srv.url)
    cut = _chunked(SSE)[:-20]
    async with RawServer(lambda n: cut, close_after=True) as srv, UpstreamClient() as c:
        with pytest.raises(httpx.RemoteProtocolError, match="complete message body"):
            await _post(c, srv.url)
    async with RawServer(lambda n: b"SPAM 12 nope\r\n\r\n") as srv, UpstreamClient() as c:
        with pytest.raises(httpx.RemoteProtocolError, match="malformed"):
            await _post(c, srv.url)
    silent = b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nab"
    async with RawServer(lambda n: silent) as srv, UpstreamClient(timeout_s=0.3) as c:
        with pytest.raises(httpx.ReadTimeout):
            await _post(c, srv.url)
    async with UpstreamClient(connect_timeout_s=2.0) as c:
        with pytest.raises(httpx.ConnectError):
            await _post(c, f"http://127.0.0.1:{free_port()}/generate")
        with pytest.raises(httpx.UnsupportedProtocol):
            await _post(c, "ftp://127.0.0.1/generate")


@run
async def test_leaving_mid_body_closes_the_connection() -> None:
    answers = [_chunked(SSE)[: -len(b"0\r\n\r\n") - 20], _chunked(SSE)]  # the first: its end never comes
    async with RawServer(lambda n: answers[n]) as srv, UpstreamClient() as c:
        async with c.stream(srv.url, b"{}", {}) as r:
            async for _ in r.aiter_bytes():
                break  # left before the end: this connection's next bytes would belong to nobody
        assert c.idle_connections == 0
        assert await _post(c, srv.url) == (200, b"".join(SSE))
        assert srv.connections == 2 and c.idle_connections == 1


def _uvicorn_app() -> Starlette:
    async def generate(request: Request) -> Response:
        n = int((await request.json())["n"])

        async def events() -> AsyncIterator[bytes]:
            for i in range(n):
                yield b'data: {"i":%d}\n\n' % i
                await asyncio.sleep(0)
            yield b"data: [DONE]\n\n"

        if n < 0:
            return Response(b"plain", media_type="text/plain")
        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/generate", generate, methods=["POST"])])


@run
async def test_uvicorn_streams_and_plain_responses_concurrently() -> None:
    srv = await asyncio.to_thread(AppThread, _uvicorn_app())
    try:
        async with UpstreamClient() as c:
            url = f"{srv.url}/generate"

            async def one(n: int) -> bytes:
                return (await _post(c, url, b'{"n":%d}' % n))[1]

            got = await asyncio.gather(*(one(n) for n in [*range(40), -1, -1]))
            for n, body in enumerate(got[:40]):
                assert body == b"".join(b'data: {"i":%d}\n\n' % i for i in range(n)) + b"data: [DONE]\n\n"
            assert got[40:] == [b"plain", b"plain"]
            assert 0 < c.idle_connections <= 42
            idle = c.idle_connections
            assert await one(3) and c.idle_connections == idle  # one was taken and given back
    finally:
        await asyncio.to_thread(srv.stop)
