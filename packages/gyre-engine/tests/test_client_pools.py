"""The engine client's connection pools: health probes and aborts each have their own, so requests that
fill or hang in the general pool (a load of calls, an engine too busy to answer) cannot keep a probe from
answering or an abort from going out; a bounded abort gives up by its timeout and leaks no connection."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from gyre_engine.client import ABORT_CONNECTIONS, EngineClient


class StuckServer:
    """A real HTTP/1.1 server on loopback that answers `GET /health` at once and never answers anything
    else (an engine too loaded to reply), counting what it got."""

    def __init__(self) -> None:
        self.held: dict[str, int] = {}
        self.server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line = head.split(b"\r\n", 1)[0].decode()
                length = next(
                    (
                        int(h.split(b":")[1])
                        for h in head.split(b"\r\n")
                        if h.lower().startswith(b"content-length")
                    ),
                    0,
                )
                await reader.readexactly(length)
                path = line.split()[1]
                if path != "/health":
                    self.held[path] = self.held.get(path, 0) + 1
                    await asyncio.Event().wait()  # never answered
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass

    async def stop(self) -> None:
        assert self.server is not None
        for w in self._writers:
            w.close()
        self.server.close()


@pytest.mark.timeout(120)
def test_probes_and_aborts_are_not_stuck_behind_a_full_pool() -> None:
    async def main() -> None:
        srv = StuckServer()
        url = await srv.start()
        async with EngineClient(url, timeout_s=60) as c:
            # 150 generate calls the engine never answers fill the general pool (httpx's 100 and a queue)
            gens = [asyncio.create_task(c.generate([1, 2, 3])) for _ in range(150)]
            while srv.held.get("/generate", 0) < 100:
                await asyncio.sleep(0.02)
            assert await c.health(timeout=5.0)  # the probes' own pool: answered
            # 100 aborts the engine takes but never answers: each gives up after its timeout
            aborts = [asyncio.create_task(c.abort(f"r{i}", timeout=2.0)) for i in range(100)]
            while srv.held.get("/generate", 0) < 100 or srv.held.get("/abort_request", 0) < ABORT_CONNECTIONS:
                await asyncio.sleep(0.02)
            t0 = time.monotonic()
            assert await c.health(timeout=5.0)  # its own pool: answered at once
            assert time.monotonic() - t0 < 5.0
            out = await asyncio.gather(*aborts, return_exceptions=True)
            assert all(isinstance(e, httpx.TimeoutException) for e in out), out
            # the aborts that timed out left the abort pool usable: the next ones reach the engine
            before = srv.held["/abort_request"]
            more = [asyncio.create_task(c.abort(f"s{i}", timeout=2.0)) for i in range(ABORT_CONNECTIONS)]
            await asyncio.gather(*more, return_exceptions=True)
            assert srv.held["/abort_request"] == before + ABORT_CONNECTIONS
            assert await c.health(timeout=5.0)
            for g in gens:
                g.cancel()
            await asyncio.gather(*gens, return_exceptions=True)
        await srv.stop()

    asyncio.run(main())


def test_clients_share_one_tls_context_that_still_verifies_certificates(tmp_path: Any) -> None:
    """Every pool of every client takes the process's one TLS context (built once: a client is cheap to
    make), and it verifies: a loopback HTTPS server with a self-signed certificate is refused."""
    import shutil
    import ssl
    import subprocess

    from gyre_engine.client import tls_context

    ctx = tls_context()
    assert ctx is tls_context() and ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a self-signed certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)

    async def go() -> None:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nOK")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=server_ctx)
        port = server.sockets[0].getsockname()[1]
        try:
            async with EngineClient(f"https://127.0.0.1:{port}", timeout_s=10) as c:
                with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                    await c.flush_cache()
        finally:
            server.close()

    asyncio.run(go())
