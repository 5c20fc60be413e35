"""The HTTP/1.1 client for the engines' streaming `/generate`: a POST on a kept-alive connection, the
response read as it arrives, with as little work per call on the event loop as that takes.

`UpstreamClient.stream(url, body, headers)` is an async context manager giving an `UpstreamResponse`
(`status_code`, `aiter_bytes()`, `aread()`) once the status line and headers are in. Bodies framed by
`Content-Length`, by chunked transfer encoding (what uvicorn sends for a stream) or by the connection's
end are read, through `httptools`' parser. Connections are kept per origin (scheme, host, port) and
reused most recently used first; at most `max_keepalive` idle ones are kept per origin, each for
`keepalive_expiry_s`, and one the server closed meanwhile is seen (its end of stream arrived) and dropped
before use. Connections in use are not capped: the calls in flight bound them (one stream per call). A
response read to its end hands its connection back; one left early (its caller cancelled, an error)
closes it, so nothing leaks whatever is cancelled when.

Failures are httpx's exceptions, so callers handle one family: `httpx.ConnectTimeout` /
`httpx.ConnectError` (connecting, `connect_timeout_s`), `httpx.WriteError`, `httpx.ReadTimeout` (no byte
for `timeout_s`), `httpx.ReadError` (reset), `httpx.RemoteProtocolError` (the server closed before the
response began or ended, or sent what is not HTTP/1.1). All are `httpx.TransportError`s.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import AsyncIterator
from typing import Self
from urllib.parse import urlsplit

import httptools
import httpx

_READ = 65536


class _Conn:
    """One kept-alive connection."""

    __slots__ = ("idle_since", "reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_since = 0.0

    def usable(self, now: float, expiry_s: float) -> bool:
        """Still open at both ends, nothing unread, not idle past `expiry_s`."""
        return now - self.idle_since < expiry_s and not self.writer.is_closing() and not self.reader.at_eof()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class _Parse:
    """httptools callbacks: the status and headers, then body pieces as they come."""

    __slots__ = ("body", "complete", "framed", "headers_done", "keep_alive", "parser")

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.keep_alive = False  # read when the message completes (the parser forgets it after that)
        self.body: list[bytes] = []
        self.headers_done = False
        self.complete = False
        self.framed = False  # Content-Length or Transfer-Encoding given: the body does not end at close

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() in (b"content-length", b"transfer-encoding"):
            self.framed = True

    def on_headers_complete(self) -> None:
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()
        self.complete = True


class UpstreamResponse:
    """A response whose status line and headers are in; its body is read with `aiter_bytes` or `aread`."""

    def __init__(
        self, conn: _Conn, parser: httptools.HttpResponseParser, state: _Parse, timeout_s: float
    ) -> None:
        self._conn = conn
        self._parser = parser
        self._state = state
        self._timeout_s = timeout_s
        self.status_code: int = parser.get_status_code()

    @property
    def complete(self) -> bool:
        return self._state.complete

    def reusable(self) -> bool:
        return self._state.complete and self._state.keep_alive

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body's pieces as they arrive (chunk framing removed)."""
        st = self._state
        while True:
            if st.body:
                pieces = st.body
                st.body = []
                for p in pieces:
                    yield p
            if st.complete:
                return
            await _feed(self._conn, self._parser, st, self._timeout_s)

    async def aread(self) -> bytes:
        return b"".join([p async for p in self.aiter_bytes()])


async def _feed(conn: _Conn, parser: httptools.HttpResponseParser, st: _Parse, timeout_s: float) -> None:
    """Read what arrives next into the parser; the connection's end completes a body that ends there."""
    try:
        async with asyncio.timeout(timeout_s):
            data = await conn.reader.read(_READ)
    except TimeoutError:
        raise httpx.ReadTimeout(f"no data from the server for {timeout_s:g} s") from None
    except OSError as exc:
        raise httpx.ReadError(f"reading the response failed: {exc!r}") from exc
    if not data:
        if st.headers_done and not st.framed:
            st.complete = True  # a body delimited by the connection's end
            return
        if not st.headers_done:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")
    try:
        parser.feed_data(data)
    except httptools.HttpParserUpgrade:
        raise httpx.RemoteProtocolError("the server switched protocols") from None
    except httptools.HttpParserError as exc:
        raise httpx.RemoteProtocolError(f"malformed response from the server: {exc}") from None


class UpstreamClient:
    """Kept-alive HTTP/1.1 connections to the engines; every method runs on one event loop."""

    def __init__(
        self,
        *,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        max_keepalive: int = 512,
        keepalive_expiry_s: float = 5.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        """`timeout_s`: longest wait for any byte of the response (and to send the request);
        `ssl_context`: for https engines (default: the system's trust store, made once here)."""
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_keepalive = max_keepalive
        self.keepalive_expiry_s = keepalive_expiry_s
        self._ssl = ssl_context
        self._idle: dict[tuple[str, str, int], list[_Conn]] = {}
        self._targets: dict[str, tuple[tuple[str, str, int], bytes]] = {}  # url -> (origin, request line)
        self._closed = False

    @property
    def idle_connections(self) -> int:
        return sum(len(v) for v in self._idle.values())

    def _target(self, url: str) -> tuple[tuple[str, str, int], bytes]:
        got = self._targets.get(url)
        if got is None:
            u = urlsplit(url)
            if u.scheme not in ("http", "https") or not u.hostname:
                raise httpx.UnsupportedProtocol(f"cannot send a request to {url!r}")
            port = u.port or (443 if u.scheme == "https" else 80)
            host = u.hostname
            path = (u.path or "/") + (f"?{u.query}" if u.query else "")
            default = (u.scheme == "https" and port == 443) or (u.scheme == "http" and port == 80)
            host_header = (f"[{host}]" if ":" in host else host) + ("" if default else f":{port}")
            head = f"POST {path} HTTP/1.1\r\nhost: {host_header}\r\n".encode("latin-1")
            got = self._targets[url] = ((u.scheme, host, port), head)
        return got

    async def _connect(self, origin: tuple[str, str, int]) -> _Conn:
        scheme, host, port = origin
        tls: ssl.SSLContext | None = None
        if scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            tls = self._ssl
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                reader, writer = await asyncio.open_connection(host, port, ssl=tls, limit=4 * _READ)
        except TimeoutError:
            raise httpx.ConnectTimeout(
                f"connecting to {host}:{port} took over {self.connect_timeout_s:g} s"
            ) from None
        except (OSError, ssl.SSLError) as exc:
            raise httpx.ConnectError(f"cannot connect to {host}:{port}: {exc}") from exc
        return _Conn(reader, writer)

    def _take(self, origin: tuple[str, str, int]) -> _Conn | None:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            c = idle.pop()
            if c.usable(now, self.keepalive_expiry_s):
                return c
            c.close()
        return None

    def _give_back(self, origin: tuple[str, str, int], c: _Conn) -> None:
        idle = self._idle.setdefault(origin, [])
        if self._closed or len(idle) >= self.max_keepalive or c.writer.is_closing():
            c.close()
            return
        c.idle_since = time.monotonic()
        idle.append(c)

    @contextlib.asynccontextmanager
    async def stream(self, url: str, body: bytes, headers: dict[str, str]) -> AsyncIterator[UpstreamResponse]:
        """POST `body` to `url` with `headers`; the response once its headers are in. Leaving the block
        before the body was read to its end closes the connection."""
        if self._closed:
            raise RuntimeError("the client is closed")
        origin, head = self._target(url)
        conn = self._take(origin) or await self._connect(origin)
        resp: UpstreamResponse | None = None
        try:
            extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items() if k.lower() != "content-length")
            conn.writer.write(head + f"{extra}content-length: {len(body)}\r\n\r\n".encode("latin-1") + body)
            if conn.writer.transport.get_write_buffer_size():
                try:
                    async with asyncio.timeout(self.timeout_s):
                        await conn.writer.drain()
                except TimeoutError:
                    raise httpx.WriteTimeout(f"sending the request took over {self.timeout_s:g} s") from None
                except OSError as exc:
                    raise httpx.WriteError(f"sending the request failed: {exc!r}") from exc
            st = _Parse()
            parser = st.parser
            while not st.headers_done:
                await _feed(conn, parser, st, self.timeout_s)
            resp = UpstreamResponse(conn, parser, st, self.timeout_s)
            yield resp
        except BaseException:
            conn.close()
            raise
        if resp.reusable():
            self._give_back(origin, conn)
        else:
            conn.close()

    async def aclose(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for c in idle:
                c.close()
        self._idle.clear()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
