"""`gyre-proxy bench`: the proxy's added latency per call and its throughput, measured side by side.

Added latency = the proxy's own time per call (from the request body in hand to the record on disk and
the response built) minus the time spent waiting on the engine, at contexts of about 1k, 100k and 500k
tokens, for incremental rendering (the proxy as it runs) and for re-rendering and re-tokenizing the whole
history each call (`incremental=False`), in the same run over the same conversations. Throughput: calls
per second with 256 concurrent sessions (multi-turn, over HTTP) against an instant engine; every record
must be in the fsynced log and arrive over the ZeroMQ PUSH. The engine here is a BENCH ENGINE: it speaks
SGLang's /generate and answers at once with a fixed tool call, so only the proxy is measured. Tokenizer:
the embedded default's (trained locally with `tokenizers`, as gyre-engine's model factory does).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import uvicorn
import zmq
from gyre_engine.tokenizer import train_bpe
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from tokenizers import Tokenizer

from gyre_proxy.app import build_app
from gyre_proxy.config import KEEP_ALIVE_S, ProxyConfig
from gyre_proxy.core import Proxy

_CORPUS = [
    "json",
    "argparse",
    "textwrap",
    "dataclasses",
    "unittest",
    "asyncio.tasks",
    "csv",
    "email.message",
    "typing",
    "inspect",
    "pathlib",
    "subprocess",
    "logging",
    "collections",
    "functools",
]
TOOL_CALL = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>'
TOOLS = [
    {
        "name": "bash",
        "description": "Run a shell command",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
    }
]


def corpus() -> list[str]:
    out = []
    for name in _CORPUS:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            out.append(Path(spec.origin).read_text(encoding="utf-8"))
    return out


def make_tokenizer(out_dir: Path) -> Tokenizer:
    """The embedded default's tokenizer (gyre-engine's torch-free recipe), saved to `out_dir`."""
    tok: Tokenizer = train_bpe()
    tok.save(str(out_dir / "tokenizer.json"))
    return tok


class Server:
    def __init__(self, app: Any) -> None:
        from gyre_base.ports import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            log_level="error",
            lifespan="on",
            backlog=4096,
            limit_concurrency=None,
            timeout_keep_alive=KEEP_ALIVE_S,
        )
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


class _BenchParams(msgspec.Struct):
    stream_interval: int | None = None


class _BenchReq(msgspec.Struct):
    rid: str = ""
    input_ids: msgspec.Raw = msgspec.Raw(b"[]")  # not decoded: the bench engine does no work per token
    sampling_params: _BenchParams = msgspec.field(default_factory=_BenchParams)


def sglang_chunks(tok: Tokenizer, out: list[int], interval: int) -> bytes:
    """The SSE body SGLang 0.5.23 streams for `out` (gyre-engine's tests/fixtures/sglang-0.5.23): cumulative
    chunks after the first token and then every `interval` tokens, and the finished one; SGLang's
    bookkeeping fields on each, `response_sent_to_client_ts` on the first only, `e2e_latency` and
    `weight_versions` on the finished one only. The request id is the placeholder `_RID` (see `generate`)."""
    ends = [*range(1, len(out), max(1, interval)), len(out)]
    body = b""
    for n in ends:
        done = n == len(out)
        meta: dict[str, Any] = {
            "id": _RID,
            "finish_reason": {"type": "stop", "matched": out[-1]} if done else None,
            "prompt_tokens": 0,
            "weight_version": "1",
            "num_retractions": 0,
            "input_token_logprobs": [],
            "output_token_logprobs": [[-0.5, t, None] for t in out[:n]],
            "output_token_logprobs_length": n,
            "reasoning_tokens": 0,
            "completion_tokens": n,
            "cached_tokens": 0,
        }
        if done:
            meta["weight_versions"] = [{"version": "1", "start": 0, "end": n}]
        meta |= {"cached_tokens_details": {"device": 0, "host": 0}, "dp_rank": None}
        if n == 1:
            meta["response_sent_to_client_ts"] = 0.0
        if done:
            meta["e2e_latency"] = 0.0
        chunk = {
            "text": tok.decode(out[:n], skip_special_tokens=False),
            "output_ids": out[:n],
            "meta_info": meta,
        }
        body += b"data: " + msgspec.json.encode(chunk) + b"\n\n"
    return body + b"data: [DONE]\n\n"


_RID = "gyre-bench-rid-placeholder"


def bench_engine(tok: Tokenizer) -> Starlette:
    """BENCH ENGINE: SGLang's streaming /generate, answering at once with a fixed tool call, in the chunks
    SGLang would send for the request's `stream_interval`."""
    im_end = tok.token_to_id("<|im_end|>")
    assert im_end is not None, "the tokenizer has no <|im_end|>"
    out = [*tok.encode(TOOL_CALL, add_special_tokens=False).ids, im_end]
    dec = msgspec.json.Decoder(_BenchReq)
    bodies: dict[int, bytes] = {}
    placeholder = msgspec.json.encode(_RID)

    async def generate(request: Request) -> Response:
        body = dec.decode(await request.body())
        interval = body.sampling_params.stream_interval or 1
        if interval not in bodies:
            bodies[interval] = sglang_chunks(tok, out, interval)
        sse = bodies[interval].replace(placeholder, msgspec.json.encode(body.rid))
        return Response(sse, media_type="text/event-stream")

    return Starlette(routes=[Route("/generate", generate, methods=["POST"])])


def history(tok: Tokenizer, target_tokens: int, chunk_tokens: int = 2000) -> list[dict[str, Any]]:
    """A conversation of about `target_tokens`: a task, then tool calls and results of real source text."""
    text = "\n".join(corpus())
    ids = tok.encode(text, add_special_tokens=False).ids
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "Refactor the project."}]
    total, i, k = 0, 0, 0
    while total < target_tokens:
        piece = tok.decode(ids[i : i + chunk_tokens])
        i = (i + chunk_tokens) % max(1, len(ids) - chunk_tokens)
        tid = f"toolu_hist_{k}"
        msgs.append(
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": tid, "name": "bash", "input": {"command": f"cat part{k}.py"}}
                ],
            }
        )
        msgs.append(
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tid, "content": piece}]}
        )
        total += chunk_tokens + 40
        k += 1
    return msgs


def run_session(url: str, base: list[dict[str, Any]], steps: int, ex: str, tail: str) -> None:
    msgs = list(base)
    with httpx.Client(timeout=600) as c:
        for s in range(steps):
            body = {
                "model": "m",
                "max_tokens": 64,
                "system": "You are a coding agent.",
                "tools": TOOLS,
                "messages": msgs,
            }
            r = c.post(f"{url}/v1/messages", json=body, headers={"x-gyre-execution": ex})
            r.raise_for_status()
            content = r.json()["content"]
            tid = next(b["id"] for b in content if b["type"] == "tool_use")
            msgs = [
                *msgs,
                {"role": "assistant", "content": content},
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": tid,
                            "content": f"{tail} step {s}: total 12\nfile_{s}.py",
                        }
                    ],
                },
            ]


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def latency(
    tok_dir: Path,
    tok: Tokenizer,
    engine_url: str,
    sizes: dict[str, int],
    steps: int,
    full_steps: int,
    tmp: Path,
) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for name, n in sizes.items():
        base = history(tok, n)
        for mode, incremental, k in (("incremental", True, steps), ("full_rerender", False, full_steps)):
            cfg = ProxyConfig(
                tokenizer=str(tok_dir),
                engines=(engine_url,),
                record_log=str(tmp / f"lat-{name}-{mode}.msgpack"),
                max_context_tokens=2_000_000,
                incremental=incremental,
            )
            proxy = Proxy(cfg, tok)
            srv = Server(build_app(proxy))
            try:
                run_session(srv.url, base, 1, f"lat-{name}", "warm")  # first call renders everything
                proxy.stats.added_ms.clear()
                run_session(srv.url, base, k + 1, f"lat-{name}", "x")
                lat = list(proxy.stats.added_ms)[1:]  # the first of these re-renders the new base turn
            finally:
                srv.stop()
            res[f"p50_ms_{name}_{mode}"] = round(pct(lat, 50), 3)
            res[f"p99_ms_{name}_{mode}"] = round(pct(lat, 99), 3)
        res[f"ratio_{name}"] = round(
            res[f"p50_ms_{name}_full_rerender"] / res[f"p50_ms_{name}_incremental"], 1
        )
    return res


async def _load(url: str, sessions: int, turns: int) -> int:
    limits = httpx.Limits(max_connections=16, max_keepalive_connections=16)
    done = 0
    clients = [httpx.AsyncClient(timeout=600, limits=limits) for _ in range(max(1, sessions // 16))]
    try:

        async def one(i: int) -> None:
            nonlocal done
            c = clients[i % len(clients)]
            msgs: list[dict[str, Any]] = [{"role": "user", "content": f"task {i}: list the files"}]
            for s in range(turns):
                body = {"model": "m", "max_tokens": 64, "tools": TOOLS, "messages": msgs}
                r = await c.post(f"{url}/v1/messages", json=body, headers={"x-gyre-execution": f"load-{i}"})
                r.raise_for_status()
                content = r.json()["content"]
                tid = next(b["id"] for b in content if b["type"] == "tool_use")
                msgs = [
                    *msgs,
                    {"role": "assistant", "content": content},
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": tid, "content": f"f{s}.py"}],
                    },
                ]
                done += 1

        await asyncio.gather(*(one(i) for i in range(sessions)))
    finally:
        for c in clients:
            await c.aclose()
    return done


def throughput(tok_dir: Path, tok: Tokenizer, engine_url: str, turns: int, tmp: Path) -> dict[str, Any]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    log_path = tmp / "load.msgpack"
    cfg = ProxyConfig(
        tokenizer=str(tok_dir),
        engines=(engine_url,),
        record_log=str(log_path),
        record_push=f"tcp://127.0.0.1:{port}",
    )
    proxy = Proxy(cfg, tok)
    srv = Server(build_app(proxy))
    try:
        import subprocess
        import sys

        p = subprocess.run(
            [sys.executable, "-m", "gyre_proxy.bench.run", "load", srv.url, "256", str(turns)],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if p.returncode != 0:
            raise RuntimeError(f"the load generator failed (exit {p.returncode}):\n{p.stderr[-4000:]}")
        load = json.loads(p.stdout.strip().splitlines()[-1])
        done, wall = int(load["done"]), float(load["wall_s"])
        added = list(proxy.stats.added_ms)
    finally:
        srv.stop()
    from gyre_traj.io import read_records

    logged = sum(1 for _ in read_records(log_path))
    pushed = 0
    while pull.poll(200):
        pull.recv()
        pushed += 1
    pull.close()
    ctx.term()
    return {
        "calls_per_s_256": round(done / wall, 1),
        "calls_256": done,
        "records_logged": logged,
        "records_pushed": pushed,
        "records_lost": done - min(logged, pushed),
        "p50_ms_added_under_load": round(pct(added, 50), 3),
    }


class EngineProc:
    """The bench engine in its own process, so its work does not share the proxy's interpreter."""

    def __init__(self, tok_dir: Path) -> None:
        import subprocess
        import sys

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gyre_proxy.bench.run", "engine", str(tok_dir)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("http://"):
            self.stop()
            raise RuntimeError(f"bench engine did not start: {line!r}")
        self.url = line.strip()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except Exception:
            self.proc.kill()
            self.proc.wait(10)


def run_bench(quick: bool = False) -> dict[str, Any]:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        tok = make_tokenizer(tmp)
        eng = EngineProc(tmp)
        try:
            sizes = {"1k": 1_000, "100k": 100_000, "500k": 500_000}
            res: dict[str, Any] = {"quick": quick}
            res.update(latency(tmp, tok, eng.url, sizes, 5 if quick else 20, 2 if quick else 5, tmp))
            res.update(throughput(tmp, tok, eng.url, 2 if quick else 4, tmp))
        finally:
            eng.stop()
    return res


def _serve_engine(tok_dir: str) -> None:
    tok = Tokenizer.from_file(str(Path(tok_dir) / "tokenizer.json"))
    import os

    parent = os.getppid()
    srv = Server(bench_engine(tok))
    print(srv.url, flush=True)
    try:
        while srv.thread.is_alive() and os.getppid() == parent:  # never outlive the benchmark
            time.sleep(0.5)
    finally:
        srv.stop()


def _load_main(url: str, sessions: int, turns: int) -> None:
    t0 = time.perf_counter()
    done = asyncio.run(_load(url, sessions, turns))
    print(json.dumps({"done": done, "wall_s": time.perf_counter() - t0}), flush=True)


if __name__ == "__main__":
    import sys

    if sys.argv[1] == "engine":
        _serve_engine(sys.argv[2])
    elif sys.argv[1] == "load":
        _load_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
