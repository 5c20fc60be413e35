"""SGLang 0.5.23's recorded HTTP replies, and a loopback server that sends them again, byte for byte.

The fixtures (`fixtures/sglang-0.5.23/*.json`) were written by `scripts/sglang_fixtures.py` from sglang's
own HTTP layer (its FastAPI app, TokenizerManager and DetokenizerManager, with a stand-in scheduler; see
`scripts/sglang_standin.py`). `ReplayServer` is a TEST FIXTURE: a real HTTP server on 127.0.0.1 that
answers a request whose `rid` (for /generate) or path names a fixture with that fixture's status and
body, and a streaming one with its recorded `data:` events in SSE framing, so a client is tested against
exactly what SGLang sent.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gyre_base.testing import AppThread

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "sglang-0.5.23"


def fixture(name: str) -> dict[str, Any]:
    return dict(json.loads((FIXTURES / f"{name}.json").read_text()))


def all_fixtures() -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(FIXTURES.glob("*.json")) if p.name != "MANIFEST.json"]


def manifest() -> dict[str, Any]:
    return dict(json.loads((FIXTURES / "MANIFEST.json").read_text()))


def events(name: str) -> list[Any]:
    """A recorded stream's `data:` events, in order (the last is the string "[DONE]")."""
    return list(fixture(name)["events"])


def sse(evs: list[Any]) -> bytes:
    """Events in SGLang's SSE framing: `data: <json>` then a blank line; `data: [DONE]` at the end."""
    out = b""
    for ev in evs:
        payload = ev if isinstance(ev, str) else json.dumps(ev, separators=(",", ":"))
        out += b"data: " + payload.encode() + b"\n\n"
    return out


class ReplayServer:
    """TEST FIXTURE: replays fixtures over real HTTP on loopback (see the module docstring)."""

    def __init__(self) -> None:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import Response
        from starlette.routing import Route

        async def generate(request: Request) -> Response:
            body = json.loads(await request.body())
            return self.reply(fixture(str(body.get("rid"))))

        async def other(request: Request) -> Response:
            name = request.path_params["path"].replace("/", "_").replace("v1_", "")
            return self.reply(fixture(self.names.get(name, name)))

        self.names: dict[str, str] = {"loads": "loads_idle"}
        app = Starlette(
            routes=[
                Route("/generate", generate, methods=["POST"]),
                Route("/{path:path}", other, methods=["GET", "POST"]),
            ]
        )
        self.http = AppThread(app, lifespan="off")
        self.url = self.http.url

    @staticmethod
    def reply(fx: dict[str, Any]) -> Any:
        from starlette.responses import Response

        if "events" in fx and fx["status"] == 200 and fx["content_type"].startswith("text/event-stream"):
            return Response(sse(fx["events"]), fx["status"], media_type="text/event-stream")
        if fx["body"] is None:
            return Response((fx["text"] or "").encode(), fx["status"], media_type=fx["content_type"] or None)
        content = json.dumps(fx["body"]).encode()
        return Response(content, fx["status"], media_type="application/json")

    def stop(self) -> None:
        self.http.stop()
