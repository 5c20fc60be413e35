"""The run's sampler reads an SGLang engine's load from what SGLang serves, and gyre-engine's counters
from gyre-engine, each from a real HTTP server on loopback.

The SGLang side is a TEST FIXTURE serving replies recorded from sglang 0.5.23's own HTTP layer
(gyre-engine's tests/fixtures/sglang-0.5.23): its `/server_info` (configuration, no request counters),
`/v1/loads` (per-rank load, cumulative prefill tokens and decode steps) and `/model_info`. The
gyre-engine side serves gyre-engine's own `ServerInfo` record.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import uvicorn
from gyre.measure.metrics import engine_activity
from gyre_base.ports import free_port
from gyre_engine.client import EngineClient
from gyre_engine.protocol import ServerInfo
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

FIXTURES = (
    Path(__file__).resolve().parents[2] / "packages" / "gyre-engine" / "tests" / "fixtures" / "sglang-0.5.23"
)


def recorded(name: str) -> Any:
    return json.loads((FIXTURES / f"{name}.json").read_text())["body"]


class JsonServer:
    """TEST FIXTURE: a loopback HTTP server answering GET `path` with `self.replies[path]` as JSON."""

    def __init__(self, replies: dict[str, Any]) -> None:
        self.replies = replies

        async def reply(request: Request) -> Response:
            body = self.replies.get("/" + request.path_params["path"])
            if body is None:
                return Response(b'{"detail": "Not Found"}', 404, media_type="application/json")
            return Response(msgspec.json.encode(body), media_type="application/json")

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        app = Starlette(routes=[Route("/{path:path}", reply)])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def gyre_info(running: int, decode_steps: int) -> ServerInfo:
    return ServerInfo("7", running, 0, False, [], 100, 0, decode_steps, decode_steps, 0)


@pytest.fixture
def engines() -> Iterator[tuple[JsonServer, JsonServer]]:
    sglang = JsonServer(
        {
            "/server_info": recorded("server_info"),
            "/v1/loads": recorded("loads_busy"),
            "/model_info": recorded("model_info"),
        }
    )
    gyre = JsonServer({"/server_info": gyre_info(0, 10)})
    yield sglang, gyre
    sglang.stop()
    gyre.stop()


def test_sglang_and_gyre_engines_report_their_load(engines: tuple[JsonServer, JsonServer]) -> None:
    sglang, gyre = engines

    async def go() -> list[tuple[dict[int, bool], dict[int, str]]]:
        clients = {0: EngineClient(sglang.url, timeout_s=5), 1: EngineClient(gyre.url, timeout_s=5)}
        work: dict[int, int] = {}
        seen = [await engine_activity(clients, work)]  # SGLang: a request running
        sglang.replies["/v1/loads"] = recorded("loads_idle")  # nothing running, counters as they were
        idle = recorded("loads_idle")
        seen.append(await engine_activity(clients, work))
        idle["loads"][0]["total_prefill_uncached_tokens"] += 5  # it computed between two samples
        sglang.replies["/v1/loads"] = idle
        gyre.replies["/server_info"] = gyre_info(0, 11)
        seen.append(await engine_activity(clients, work))
        seen.append(await engine_activity(clients, work))  # nothing moved
        gyre.replies["/server_info"] = gyre_info(2, 11)
        seen.append(await engine_activity(clients, work))
        for c in clients.values():
            await c.aclose()
        return seen

    seen = asyncio.run(go())
    assert [s[0] for s in seen] == [
        {0: True, 1: False},
        {0: True, 1: False},  # the recorded idle snapshot's counters differ from the busy one's
        {0: True, 1: True},
        {0: False, 1: False},
        {0: False, 1: True},
    ]
    assert seen[0][1] == {0: "default", 1: "7"}  # SGLang's version from /model_info
    # the counters as each server reports them: SGLang's decode moments (steps, batch sizes, step us) and
    # uncached prefill tokens from its recorded /v1/loads (its prefill busy time there is 0: not counted)
    assert seen[0][2][0] == {"decode_steps": 271, "decode_tokens": 273, "decode_s": 4.232925,
                             "prefill_tokens": 46, "prefill_s": None, "evicted_tokens": None,
                             "host_spilled_tokens": None, "host_hit_tokens": None, "step_s": None,
                             "command_s": None, "waiting_s": None, "graph_captures": None,
                             "graph_capture_s": None, "prefill_passes": None, "prefill_graph_passes": None,
                             "waiting": 0}  # fmt: skip
    assert seen[4][2][1] == {"decode_steps": 11, "decode_tokens": 11, "decode_s": 0.0, "prefill_tokens": 100,
                             "prefill_s": 0.0, "evicted_tokens": 0, "host_spilled_tokens": 0,
                             "host_hit_tokens": 0, "step_s": 0.0, "command_s": 0.0, "waiting_s": None,
                             "graph_captures": 0, "graph_capture_s": 0.0, "prefill_passes": 0,
                             "prefill_graph_passes": 0, "waiting": 0}  # fmt: skip
