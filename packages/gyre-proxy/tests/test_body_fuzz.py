"""An HTTP fuzz of request bodies against a real `gyre-proxy serve` process: batches of 25 sent at
once (12 batches, 300 requests, in the default run; 40, 1,000 requests, in the `long` one), good requests mixed with garbage, bodies over the bound (declared by their
`Content-Length`, or sent chunked past the bound and never finished), bodies within the bound whose text cannot fit the
context, bodies of many thousand tiny blocks, deep nesting and truncated JSON.

Every answer is below 500 and, when an error, in the API's shape (413 for a body over the bound or a
prompt over the context); a chunked body over the bound is refused although it never ends; every good
request is answered, and the good request sent after each batch within 10 s (a
timeout, not a speed figure: a proxy busy with one body must still serve the others). The figures
(calls over 10 s, the proxy's RSS before, at its peak and after, 5xx answers) are printed for the
package README; the engine is the scripted test engine (a fixture speaking SGLang's /generate)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from gyre_base.testing import free_port, until

from .conftest import ScriptedEngine

pytestmark = [pytest.mark.fuzz, pytest.mark.slow]

BOUND = 4 * 1024 * 1024  # the fuzzed proxy's --max-body-bytes (the default is 32 MiB)
BATCH = 25
GOOD_A = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
GOOD_O = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
PATHS = {"anthropic": "/v1/messages", "openai": "/v1/chat/completions"}


@dataclass
class Target:
    url: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    def rss_kib(self, key: str = "VmRSS") -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
        raise AssertionError(f"no {key} for the proxy")


@pytest.fixture
def target(engine: ScriptedEngine, tokenizer_dir: Path, tmp_path: Path) -> Iterator[Target]:
    engine.default = "ok"
    port = free_port()
    log = tmp_path / "proxy.log"
    cmd = [sys.executable, "-m", "gyre_proxy.cli", "serve", "--tokenizer", str(tokenizer_dir)]
    cmd += ["--engine", engine.url, "--port", str(port), "--record-log", str(tmp_path / "records.msgpack")]
    cmd += ["--max-body-bytes", str(BOUND), "--pick-wait", "30"]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
    t = Target(f"http://127.0.0.1:{port}", port, proc, log)

    def up() -> bool:
        assert proc.poll() is None, f"the proxy died; see {log}"
        try:
            return httpx.get(f"{t.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        until(up, "gyre-proxy serve up", 120)
        yield t
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert b"Traceback" not in log.read_bytes(), f"the proxy logged a traceback; see {log}"


@dataclass
class Tally:
    latencies: list[float] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)
    kinds: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, status: int, seconds: float) -> None:
        self.latencies.append(seconds)
        self.statuses[status] = self.statuses.get(status, 0) + 1
        self.kinds[kind] = self.kinds.get(kind, 0) + 1


def _check_error(api: str, status: int, raw: bytes) -> None:
    data = json.loads(raw)
    if api == "anthropic":
        assert data["type"] == "error" and isinstance(data["error"]["message"], str), raw[:300]
        if status == 413:
            assert data["error"]["type"] == "request_too_large", raw[:300]
    else:
        assert set(data["error"]) == {"message", "type", "param", "code"}, raw[:300]


async def _raw(port: int, head: str, chunks: Any, stop_early: bool) -> tuple[int, bytes, int]:
    """Send `head` then the body `chunks` (bytes each) over a raw connection; with `stop_early`, stop
    sending as soon as the proxy answers. (status, body of the answer, body bytes sent)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    sent = 0
    try:
        writer.write(head.encode("latin-1"))
        answer = asyncio.ensure_future(reader.readuntil(b"\r\n\r\n"))
        for chunk in chunks:
            if stop_early and answer.done():
                break
            writer.write(chunk)
            sent += len(chunk)
            try:
                await writer.drain()
            except ConnectionError:  # the proxy answered and closed: the rest is not wanted
                break
            await asyncio.sleep(0)
        head_bytes = await asyncio.wait_for(answer, 60)
        status = int(head_bytes.split(b" ", 2)[1])
        length = next(
            int(h.split(b":")[1])
            for h in head_bytes.split(b"\r\n")
            if h.lower().startswith(b"content-length:")
        )
        body = await asyncio.wait_for(reader.readexactly(length), 60)
        return status, body, sent
    finally:
        writer.close()


def _chunked(total: int, piece: int = 256 * 1024) -> Iterator[bytes]:
    """`total` bytes of a chunked-encoding body of JSON-ish text, without its end."""
    data = b'{"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "' + b"a" * piece
    first = True
    while total > 0:
        part = data if first else b"a" * piece
        first = False
        total -= len(part)
        yield b"%x\r\n" % len(part) + part + b"\r\n"


def _huge_text(api: str) -> bytes:
    """Within the bound, valid, and far beyond the model's context."""
    text = "word " * ((BOUND - 4096) // 5)
    return json.dumps(
        {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": text}]}
    ).encode()


def _many_blocks(api: str) -> bytes:
    """Within the bound: tens of thousands of tiny content parts."""
    if api == "anthropic":
        blocks = [{"type": "text", "text": "a"}] * 60000
    else:
        blocks = [{"type": "text", "text": "a"}] * 60000
    return json.dumps(
        {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": blocks}]}
    ).encode()


async def _one(t: Target, rnd: random.Random, tally: Tally, client: httpx.AsyncClient) -> None:
    api = rnd.choice(["anthropic", "openai"])
    path = PATHS[api]
    kind = rnd.choices(
        ["good", "garbage", "over_declared", "over_chunked", "huge_text", "many_blocks", "deep", "truncated"],
        [12, 4, 2, 1, 2, 1, 1, 1],
    )[0]
    t0 = time.monotonic()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
    if kind == "over_declared":
        size = rnd.randint(BOUND + 1, 64 * BOUND)
        status, body, _ = await _raw(t.port, head + f"Content-Length: {size}\r\n\r\n", [b"{" * 65536], True)
        assert status == 413, body
    elif kind == "over_chunked":
        # past the bound and never finished: answered without the whole body, or never
        status, body, _ = await _raw(
            t.port, head + "Transfer-Encoding: chunked\r\n\r\n", _chunked(BOUND + 1024 * 1024), False
        )
        assert status == 413, body
    else:
        if kind == "good":
            content = json.dumps(GOOD_A if api == "anthropic" else GOOD_O).encode()
        elif kind == "garbage":
            content = rnd.randbytes(rnd.randint(0, 65536))
        elif kind == "huge_text":
            content = _huge_text(api)
        elif kind == "many_blocks":
            content = _many_blocks(api)
        elif kind == "deep":
            content = b"[" * 200000 + b"]" * 200000
        else:
            full = json.dumps(GOOD_A).encode()
            content = full[: rnd.randint(0, len(full) - 1)]
        r = await client.post(f"{t.url}{path}", content=content, headers={"content-type": "application/json"})
        status, body = r.status_code, r.content
        if kind == "good":
            assert status == 200, body[:300]
        elif kind == "huge_text":
            assert status == 413, body[:300]
    assert status < 500, (kind, status, body[:300])
    if status >= 400:
        _check_error(api, status, body)
    tally.add(kind, status, time.monotonic() - t0)


def test_bodies_huge_and_garbage_300_requests(target: Target) -> None:
    """12 batches of 25 mixed requests (300), a good request after each batch (module docstring)."""
    _fuzz_bodies(target, 12)


@pytest.mark.long
def test_bodies_huge_and_garbage_1000_requests(target: Target) -> None:
    """40 batches of 25 mixed requests (1,000), a good request after each batch (module docstring)."""
    _fuzz_bodies(target, 40)


def _fuzz_bodies(target: Target, batches: int) -> None:
    seed = int(os.environ.get("GYRE_FUZZ_SEED", time.time_ns() % 2**32))
    print(f"\nseed {seed} (GYRE_FUZZ_SEED)")
    rnd = random.Random(seed)
    tally = Tally()
    rss0 = target.rss_kib()
    between: list[float] = []

    async def batch() -> None:
        limits = httpx.Limits(max_connections=BATCH)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            await asyncio.gather(*(_one(target, rnd, tally, client) for _ in range(BATCH)))

    for _ in range(batches):
        asyncio.run(batch())
        assert target.proc.poll() is None, f"the proxy died; see {target.log}"
        t0 = time.monotonic()
        r = httpx.post(f"{target.url}/v1/messages", json=GOOD_A, timeout=10)  # 10 s: the liveness bound
        between.append(time.monotonic() - t0)
        assert r.status_code == 200, r.text
    rss1, peak = target.rss_kib(), target.rss_kib("VmHWM")
    over = sum(x > 10 for x in tally.latencies)
    fives = sum(n for s, n in tally.statuses.items() if s >= 500)
    print(
        f"requests {len(tally.latencies)} by kind {tally.kinds}; statuses {tally.statuses}\n"
        f"calls over 10 s: {over}; slowest call {max(tally.latencies):.2f} s; good request after each "
        f"batch: slowest {max(between):.2f} s\n"
        f"proxy RSS: {rss0 // 1024} MB before, {peak // 1024} MB at its peak, {rss1 // 1024} MB after "
        f"(+{(rss1 - rss0) // 1024} MB); 5xx answers: {fives}"
    )
    assert len(tally.latencies) == batches * BATCH
    assert fives == 0
