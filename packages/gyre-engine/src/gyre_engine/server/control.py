"""Control of the running engine: abort requests, pause and continue generation, release and resume
memory, flush the prefix cache. Each call runs on the engine thread between two steps, with the control
deadline, and answers as SGLang 0.5.23 does (`/flush_cache` in plain text).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gyre_engine.protocol import AbortRequest, ContinueRequest, MemoryRequest, PauseRequest, StatusReply
from gyre_engine.server.engine import Engine, EngineUnavailable
from gyre_engine.server.errors import json_response
from gyre_engine.server.routing import EngineCalls, body_as, route


class ControlRoutes:
    """/abort_request, /pause_generation, /continue_generation, /release_memory_occupation,
    /resume_memory_occupation and /flush_cache over one engine."""

    def __init__(self, engine: Engine, call: EngineCalls) -> None:
        self.engine = engine
        self.call = call

    def routes(self) -> list[Route]:
        return [
            route("/abort_request", self.abort_request, "POST"),
            route("/pause_generation", self.pause_generation, "POST"),
            route("/continue_generation", self.continue_generation, "POST"),
            route("/release_memory_occupation", self.release_memory, "POST"),
            route("/resume_memory_occupation", self.resume_memory, "POST"),
            route("/flush_cache", self.flush_cache, "GET", "POST"),
        ]

    async def abort_request(self, request: Request) -> Response:
        body = await body_as(request, AbortRequest)
        if body.abort_all:
            await self.call(self.engine.abort_all)
        elif body.rid:
            await self.call(self.engine.abort, body.rid)
        return Response(b"", status_code=200)

    async def pause_generation(self, request: Request) -> Response:
        body = await body_as(request, PauseRequest)
        n = await self.call(self.engine.pause, body.mode)
        return json_response(StatusReply(f"Generation paused ({body.mode}); {n} requests affected"))

    async def continue_generation(self, request: Request) -> Response:
        body = await body_as(request, ContinueRequest)
        await self.call(self.engine.resume_generation)
        if body.torch_empty_cache:
            await self.call(_empty_device_cache, self.engine)
        return json_response(StatusReply("Generation continued"))

    async def release_memory(self, request: Request) -> Response:
        body = await body_as(request, MemoryRequest)
        await self.call(self.engine.release_memory, body.tags)
        return json_response(None)

    async def resume_memory(self, request: Request) -> Response:
        body = await body_as(request, MemoryRequest)
        await self.call(self.engine.resume_memory, body.tags)
        return json_response(None)

    async def flush_cache(self, request: Request) -> Response:
        try:
            await self.call(self.engine.flush_cache)
        except EngineUnavailable as exc:
            return Response(str(exc).encode(), status_code=400, media_type="text/plain")
        return Response(b"Cache flushed.\n", status_code=200, media_type="text/plain")


def _empty_device_cache(engine: Engine) -> None:
    if engine.device.type == "cuda":
        import torch

        torch.cuda.empty_cache()
