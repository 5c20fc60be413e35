"""The HTTP front (Starlette): Anthropic and OpenAI routes, with or without an `/e/{execution}` prefix.

The execution a call belongs to comes from, in order: the path prefix, a per-execution API key, the
`X-Claude-Code-Session-Id` header, an `X-Gyre-Execution` header, else "default". Errors come back in each
API's own shape: 400 naming the field (a request is checked whole before anything is rendered, run or
recorded), 401 for an unknown key (when keys are configured), 413 when the prompt exceeds the model, 529
(Anthropic) / 503 (OpenAI) when no engine takes the request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from gyre_proxy import anthropic_api as A
from gyre_proxy import anthropic_request as AR
from gyre_proxy import openai_api as O
from gyre_proxy import openai_request as OR
from gyre_proxy.chat import RequestError
from gyre_proxy.control import ControlLink
from gyre_proxy.core import ContextTooLong, Proxy
from gyre_proxy.engines import NoEngine
from gyre_proxy.generation import EngineRejected, GenerationFailed

log = logging.getLogger("gyre_proxy.app")
_enc = msgspec.json.Encoder()
JSON = "application/json"


class Unauthorized(Exception):
    pass


def _key(request: Request) -> str:
    key = request.headers.get("x-api-key", "")
    auth = request.headers.get("authorization", "")
    if not key and auth.lower().startswith("bearer "):
        key = auth[7:].strip()
    return key


def execution_of(proxy: Proxy, request: Request) -> str:
    keys = proxy.cfg.api_keys
    key_ex = ""
    if keys:
        key = _key(request)
        if key not in keys:
            raise Unauthorized("invalid x-api-key" if key else "missing API key")
        key_ex = keys[key]
    ex = request.path_params.get("execution", "")
    return (
        ex
        or key_ex
        or request.headers.get("x-claude-code-session-id", "")
        or request.headers.get("x-gyre-execution", "")
        or "default"
    )


def _a_error(status: int, kind: str, msg: str) -> Response:
    return Response(A.error_body(kind, msg), status, media_type=JSON)


def _o_error(status: int, kind: str, msg: str, param: str | None = None) -> Response:
    return Response(O.error_body(kind, msg, param), status, media_type=JSON)


Handler = Callable[[Request], Awaitable[Response]]


def anthropic_errors(fn: Handler) -> Handler:
    async def wrapped(request: Request) -> Response:
        try:
            return await fn(request)
        except RequestError as exc:
            return _a_error(400, "invalid_request_error", f"{exc.field}: {exc.message}")
        except EngineRejected as exc:
            return _a_error(400, "invalid_request_error", f"the engine refused the request: {exc}")
        except Unauthorized as exc:
            return _a_error(401, "authentication_error", str(exc))
        except ContextTooLong as exc:
            return _a_error(413, "request_too_large", str(exc))
        except (NoEngine, GenerationFailed) as exc:
            return _a_error(529, "overloaded_error", str(exc))

    return wrapped


def openai_errors(fn: Handler) -> Handler:
    async def wrapped(request: Request) -> Response:
        try:
            return await fn(request)
        except RequestError as exc:
            return _o_error(400, "invalid_request_error", f"{exc.field}: {exc.message}", exc.field)
        except EngineRejected as exc:
            return _o_error(400, "invalid_request_error", f"the engine refused the request: {exc}")
        except Unauthorized as exc:
            return _o_error(401, "invalid_request_error", str(exc))
        except ContextTooLong as exc:
            return _o_error(413, "invalid_request_error", str(exc), "messages")
        except (NoEngine, GenerationFailed) as exc:
            return _o_error(503, "server_error", str(exc))

    return wrapped


async def _guarded(gen: AsyncIterator[bytes], on_error: Callable[[Exception], bytes]) -> AsyncIterator[bytes]:
    """A stream that already started can only report an error in-band."""
    try:
        async for chunk in gen:
            yield chunk
    except (NoEngine, GenerationFailed, EngineRejected, RuntimeError) as exc:
        log.warning("stream failed: %s", exc)
        yield on_error(exc)


def build_app(proxy: Proxy, sched_endpoint: str = "") -> Starlette:
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await proxy.start()
        if sched_endpoint:
            assert proxy.pool is not None
            state["control"] = ControlLink(sched_endpoint, proxy.pool, asyncio.get_running_loop())
        try:
            yield
        finally:
            if "control" in state:
                await asyncio.to_thread(state["control"].close)
            await proxy.stop()

    async def ensure_engine(ex: str) -> None:
        assert proxy.pool is not None
        await proxy.pool.wait_pick(ex, proxy.cfg.pick_wait_s)

    @anthropic_errors
    async def messages(request: Request) -> Response:
        ex = execution_of(proxy, request)
        body = await request.body()
        t0 = time.perf_counter()
        req = AR.decode(body)
        assert isinstance(req, AR.ARequest)
        conv = AR.to_conversation(req, proxy.stripper)
        run = proxy.start_call(conv, AR.to_sampling(req), ex, request.headers, t0)
        await ensure_engine(ex)
        if req.stream:

            def err(exc: Exception) -> bytes:
                body = {"type": "error", "error": {"type": "overloaded_error", "message": str(exc)}}
                return b"event: error\ndata: " + _enc.encode(body) + b"\n\n"

            return StreamingResponse(
                _guarded(A.stream_events(run, req.model), err), media_type="text/event-stream"
            )
        await run.run()
        await run.finish()
        return Response(A.message_json(run, req.model), media_type=JSON)

    @anthropic_errors
    async def count_tokens(request: Request) -> Response:
        ex = execution_of(proxy, request)
        req = AR.decode(await request.body(), count=True)
        n = proxy.count_tokens(AR.to_conversation(req, proxy.stripper), ex)
        return Response(_enc.encode({"input_tokens": n}), media_type=JSON)

    async def models(request: Request) -> Response:
        try:
            execution_of(proxy, request)
        except Unauthorized as exc:
            return _a_error(401, "authentication_error", str(exc))
        m = {
            "type": "model",
            "id": proxy.cfg.model_name,
            "display_name": proxy.cfg.model_name,
            "created_at": "2026-01-01T00:00:00Z",
            "object": "model",
            "owned_by": "gyre",
        }
        body = {"data": [m], "has_more": False, "first_id": m["id"], "last_id": m["id"], "object": "list"}
        return Response(_enc.encode(body), media_type=JSON)

    @openai_errors
    async def chat_completions(request: Request) -> Response:
        ex = execution_of(proxy, request)
        body = await request.body()
        t0 = time.perf_counter()
        req = OR.decode(body)
        conv = OR.to_conversation(req, proxy.stripper)
        sampling = OR.to_sampling(req, 4096, proxy.tokenizer.get_vocab_size(with_added_tokens=True))
        run = proxy.start_call(conv, sampling, ex, request.headers, t0)
        await ensure_engine(ex)
        lps = bool(req.logprobs)
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)

            def err(exc: Exception) -> bytes:
                return b"data: " + O.error_body("server_error", str(exc)) + b"\n\n"

            return StreamingResponse(
                _guarded(O.stream_chunks(run, req.model, usage, lps), err), media_type="text/event-stream"
            )
        await run.run()
        await run.finish()
        return Response(O.completion_json(run, req.model, lps), media_type=JSON)

    async def stats(request: Request) -> Response:
        pool = proxy.pool
        engines = (
            []
            if pool is None
            else [
                {
                    "id": e.engine_id,
                    "url": e.url,
                    "state": e.state.value,
                    "in_flight": len(e.in_flight),
                    "outstanding": e.outstanding,
                    "served": e.served,
                    "failures": e.failures,
                    "revived": e.revived,
                }
                for e in pool.engines.values()
            ]
        )
        sink = proxy.sink.stats if proxy.sink else None
        body = {
            "engines": engines,
            "calls": proxy.stats.calls,
            "reused_tokens": proxy.stats.reused_tokens,
            "recorded_tokens": proxy.stats.recorded_tokens,
            "tokenized_tokens": proxy.stats.tokenized_tokens,
            "ambiguous_turns": proxy.stats.ambiguous_turns,
            "appended_calls": proxy.stats.appended_calls,
            "non_extensions": proxy.stats.non_extensions,
            "non_extensions_by_execution": {
                k: v.non_extensions for k, v in proxy.executions.items() if v.non_extensions
            },
            "restored_empty_replies": proxy.stats.restored_empty_replies,
            "moved_calls": proxy.counters.moved_calls,
            "prefix_moved_calls": proxy.counters.prefix_moved_calls,
            "prefix_moved_tokens": proxy.counters.prefix_moved_tokens,
            "reprefilled_tokens": proxy.counters.reprefilled_tokens,
            "engine_errors": proxy.counters.engine_errors,
            "records_written": sink.written if sink else 0,
            "records_pushed": sink.pushed if sink else 0,
            "records_push_dropped": sink.push_dropped if sink else 0,
            "control": state["control"].applied if "control" in state else [],
        }
        return Response(_enc.encode(body), media_type=JSON)

    async def health(request: Request) -> Response:
        return Response(b"ok")

    routes = []
    for prefix in ("", "/e/{execution}"):
        routes += [
            Route(f"{prefix}/v1/messages", messages, methods=["POST"]),
            Route(f"{prefix}/v1/messages/count_tokens", count_tokens, methods=["POST"]),
            Route(f"{prefix}/v1/models", models, methods=["GET"]),
            Route(f"{prefix}/v1/chat/completions", chat_completions, methods=["POST"]),
        ]
    routes += [Route("/gyre/stats", stats), Route("/health", health)]
    return Starlette(routes=routes, lifespan=lifespan)
