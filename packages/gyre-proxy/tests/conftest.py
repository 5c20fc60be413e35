"""Fixtures: the embedded default tokenizer, a scripted SGLang-protocol test engine, real gyre-engine
servers with the embedded tiny model, and a proxy server.

`ScriptedEngine` is a TEST FIXTURE, not an engine: a real HTTP server on loopback that speaks SGLang's
native /generate (streaming and not, logprobs, abort) and replays scripted outputs, so tool use through the
real clients is deterministic. Its responses are shaped as SGLang 0.5.23's (fields, which chunk carries
which, `stream_interval`, chunks held back at a possible stop string; see `sglang_chunk`). Its outputs are
tokenized with the policy's tokenizer; every input it receives is kept for the tests' assertions.
"""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx
import msgspec
import pytest
import zmq
from gyre_base.testing import AppThread, free_port
from gyre_proxy.app import build_app
from gyre_proxy.config import ProxyConfig
from gyre_proxy.core import Proxy
from gyre_sched.protocol import Codec as SchedCodec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from tokenizers import Tokenizer


def left_to_gc() -> list[str]:
    """The unclosed-resource warnings a garbage collection emits now (the suite turns warnings into
    errors, which would blame whichever test the collector happens to run in)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", ResourceWarning)
        gc.collect()
    return [str(w.message) for w in seen if issubclass(w.category, ResourceWarning)]


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gyre_engine.server.model_factory import train_tokenizer

    out = tmp_path_factory.mktemp("tok")
    train_tokenizer().save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))


ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


def sglang_chunk(
    rid: str,
    prompt: list[int],
    out: list[int],
    text: str,
    fin: dict[str, Any] | None,
    weight_version: str,
    logprobs: list[list[Any]],
    started: float,
    first: bool,
) -> dict[str, Any]:
    """A /generate response or stream chunk with the fields SGLang 0.5.23 sends, where it sends them
    (recorded in gyre-engine's tests/fixtures/sglang-0.5.23): `response_sent_to_client_ts` on the first
    chunk, `weight_versions` and `e2e_latency` only once finished, SGLang's bookkeeping fields throughout."""
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": fin,
        "prompt_tokens": len(prompt),
        "weight_version": weight_version,
        "num_retractions": 0,
        "input_token_logprobs": [],
        "output_token_logprobs": logprobs,
        "output_token_logprobs_length": len(out),
        "reasoning_tokens": 0,
        "completion_tokens": len(out),
        "cached_tokens": 0,
    }
    if fin is not None:
        meta["weight_versions"] = [{"version": weight_version, "start": 0, "end": len(out)}]
    meta |= {"cached_tokens_details": None, "dp_rank": None}
    if fin is not None:
        meta["e2e_latency"] = time.monotonic() - started
    if first:
        meta["response_sent_to_client_ts"] = time.time()
    return {"text": text, "output_ids": list(out), "meta_info": meta}


def sglang_sends(n: int, sent: int, interval: int, text: str, stops: list[str]) -> bool:
    """SGLang's rule for an unfinished stream chunk (its SchedulerOutputStreamer): every token at interval
    1, else the first at once and then whenever `interval` tokens are unsent; never while the text's tail
    could be the start of a stop string."""
    unsent = n - sent
    if not (interval == 1 or unsent >= interval or (sent == 0 and unsent > 0)):
        return False
    tail = text[-(max((len(x) for x in stops), default=0) + 1) :]
    return not any(x in tail or any(tail.endswith(x[:i]) for i in range(1, len(x) + 1)) for x in stops)


@dataclass
class Seen:
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    sampling_params: dict[str, Any] = field(default_factory=dict)


@dataclass
class ScriptedEngine:
    """TEST FIXTURE speaking SGLang's /generate; replays `script` (texts or functions of the input ids)."""

    tokenizer: Tokenizer
    script: list[Any] = field(default_factory=list)
    default: Any = None  # used once the script is empty
    token_delay_s: float = 0.0
    weight_version: str = "3"
    reject_next: bool = False  # answer the next /generate with HTTP 400
    die_after: int | None = None  # close the connection after this many tokens of the next request
    hold_aborts: threading.Event | None = None  # while set, /abort_request takes effect but is not answered
    seen: list[Seen] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    by_rid: dict[str, list[int]] = field(default_factory=dict)  # rid -> output ids sent
    aborted: set[str] = field(default_factory=set)
    server: AppThread | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    def logprob(self, i: int, tid: int) -> float:
        return -0.01 - ((tid * 7 + i) % 13) / 10.0

    def start(self, port: int | None = None) -> ScriptedEngine:
        im_end = self.tokenizer.token_to_id("<|im_end|>")

        async def generate(request: Request) -> Response:
            body = msgspec.json.decode(await request.body())
            ids = body["input_ids"]
            sp = body.get("sampling_params", {})
            rid = body.get("rid", f"r{len(self.seen)}")
            max_new = int(sp.get("max_new_tokens", 128))
            self.seen.append(Seen(rid, ids, max_new, sp))
            item = self.script.pop(0) if self.script else (self.default or "ok")
            if self.reject_next:
                self.reject_next = False
                # SGLang's schema error: the text alone under "error"
                return JSONResponse({"error": "unknown field `bogus`, expected one of `max_new_tokens`"}, 400)
            made = item(ids) if callable(item) else item
            stop_hit = ""
            if isinstance(made, str):
                for stop in sp.get("stop") or []:
                    if stop in made:  # like SGLang with no_stop_trim: output ends with the stop string
                        made = made[: made.index(stop) + len(stop)]
                        stop_hit = stop
                        break
            if isinstance(made, list):  # raw output ids, used as they are
                out = list(made)
            else:
                out = [*self.tokenizer.encode(made, add_special_tokens=False).ids] + (
                    [] if stop_hit else [im_end]
                )
            finish: dict[str, Any] = {"type": "stop", "matched": stop_hit or im_end}
            if len(out) > max_new:
                out = out[:max_new]
                finish = {"type": "length", "length": max_new}
            die = self.die_after
            self.die_after = None

            interval = int(sp.get("stream_interval") or 1)
            stops = [x for x in (sp.get("stop") or []) if x]
            started = time.monotonic()

            def resp(n: int, fin: dict[str, Any] | None, first: bool = False) -> dict[str, Any]:
                return sglang_chunk(
                    rid, ids, out[:n], self.tokenizer.decode(out[:n]), fin, self.weight_version,
                    [[self.logprob(i, t), t, None] for i, t in enumerate(out[:n])], started, first,
                )  # fmt: skip

            if not body.get("stream"):
                self.outputs.append(out)
                self.by_rid[rid] = out
                return JSONResponse(resp(len(out), finish, first=True))

            async def sse() -> Any:
                sent = 0
                for n in range(1, len(out) + 1):
                    if self.token_delay_s:
                        await asyncio.sleep(self.token_delay_s)
                    if die is not None and n > die:
                        raise ConnectionResetError("scripted engine dies mid-call")
                    if rid in self.aborted:
                        self.outputs.append(out[: n - 1])
                        self.by_rid[rid] = out[: n - 1]
                        yield b"data: " + msgspec.json.encode(resp(n - 1, ABORTED, sent == 0)) + b"\n\n"
                        yield b"data: [DONE]\n\n"
                        return
                    done = n == len(out)
                    if done or sglang_sends(n, sent, interval, self.tokenizer.decode(out[:n]), stops):
                        yield (
                            b"data: "
                            + msgspec.json.encode(resp(n, finish if done else None, sent == 0))
                            + b"\n\n"
                        )
                        sent = n
                self.outputs.append(out)
                self.by_rid[rid] = out
                yield b"data: [DONE]\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream")

        async def abort(request: Request) -> Response:
            body = msgspec.json.decode(await request.body())
            self.aborted.add(body.get("rid", ""))
            while self.hold_aborts is not None and self.hold_aborts.is_set():  # an engine too busy to answer
                await asyncio.sleep(0.5)
            return Response(b"")

        async def model_info(request: Request) -> Response:
            return JSONResponse({"model_path": "scripted", "weight_version": self.weight_version})

        async def ok(request: Request) -> Response:
            return Response(b"ok")

        app = Starlette(
            routes=[
                Route("/generate", generate, methods=["POST"]),
                Route("/abort_request", abort, methods=["POST"]),
                Route("/model_info", model_info),
                Route("/health", ok),
                Route("/ready", ok),
            ]
        )
        self.server = AppThread(app, port, lifespan="on")
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


@pytest.fixture
def engine(tokenizer: Tokenizer) -> Iterator[ScriptedEngine]:
    eng = ScriptedEngine(tokenizer).start()
    yield eng
    eng.stop()


@pytest.fixture
def engines2(tokenizer: Tokenizer) -> Iterator[tuple[ScriptedEngine, ScriptedEngine]]:
    a = ScriptedEngine(tokenizer).start()
    b = ScriptedEngine(tokenizer).start()
    yield a, b
    a.stop()
    b.stop()


@dataclass
class ProxyServer:
    proxy: Proxy
    server: AppThread
    log_path: Path

    @property
    def url(self) -> str:
        return self.server.url


@pytest.fixture
def make_proxy(tokenizer_dir: Path, tmp_path: Path) -> Iterator[Callable[..., ProxyServer]]:
    started: list[ProxyServer] = []

    def make(engines: list[str], sched: str = "", **kw: Any) -> ProxyServer:
        kw.setdefault("record_log", str(tmp_path / f"records{len(started)}.msgpack"))
        kw.setdefault("tokenizer", str(tokenizer_dir))
        log_path = Path(kw["record_log"])
        cfg = ProxyConfig(engines=tuple(engines), sched=sched, **kw)
        proxy = Proxy(cfg)
        ps = ProxyServer(proxy, AppThread(build_app(proxy), lifespan="on"), log_path)
        started.append(ps)
        return ps

    yield make
    for ps in started:
        ps.server.stop()


class SchedStub:
    """A real ROUTER speaking gyre-sched's protocol, standing in for the scheduler's socket."""

    def __init__(self) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.codec = SchedCodec()
        self.ident = b""

    def recv(self, timeout_s: float = 10.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.sock.poll(50):
                ident, data = self.sock.recv_multipart()
                self.ident = ident
                return self.codec.decode(data)
        raise TimeoutError("no message from the proxy")

    def expect(self, kind: type, timeout_s: float = 10.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            msg = self.recv(max(0.1, deadline - time.monotonic()))
            if isinstance(msg, kind):
                return msg

    def send(self, msg: Any) -> None:
        self.sock.send_multipart([self.ident, self.codec.encode(msg)])

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


@pytest.fixture
def sched_stub() -> Iterator[SchedStub]:
    s = SchedStub()
    yield s
    s.close()


# ---------------------------------------------------------------------------------------------------
# real gyre-engine servers (the embedded tiny model on the CPU), shared by the session


class EngineProc:
    """A `gyre-engine serve` subprocess with the tiny model; its output goes to `log_path`."""

    def __init__(self, model: Path, log_path: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log: IO[bytes] = open(log_path, "ab")  # noqa: SIM115 - closed by stop()
        cmd = [sys.executable, "-m", "gyre_engine", "serve", "--model", str(model)]
        cmd += ["--port", str(self.port), "--device", "cpu"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gyre-engine exited early ({self.proc.returncode}); see {self.log.name}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"gyre-engine did not become ready in {timeout_s:.0f} s")
            time.sleep(0.3)

    def rows(self) -> int:
        """Requests running or waiting on the engine."""
        info = httpx.get(f"{self.url}/server_info", timeout=10).json()
        return int(info["running_requests"]) + int(info["waiting_requests"])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(20)
        self.log.close()


@dataclass
class TinyEngines:
    model: Path
    procs: list[EngineProc]  # replaceable by a test (one that restarts an engine puts the new one here)
    logs: Path

    @property
    def urls(self) -> list[str]:
        return [p.url for p in self.procs]


@pytest.fixture(scope="session")
def tiny_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinyEngines]:
    """Two gyre-engine servers with the same embedded tiny model (started together: each takes a while)."""
    from gyre_engine.server.model_factory import create_model

    model = create_model(tmp_path_factory.mktemp("tiny") / "model", "tiny")
    logs = tmp_path_factory.mktemp("elog")
    engines = TinyEngines(model, [EngineProc(model, logs / f"engine{i}.log") for i in range(2)], logs)
    try:
        for e in engines.procs:
            e.wait_ready()
        yield engines
    finally:
        for e in engines.procs:
            e.stop()
