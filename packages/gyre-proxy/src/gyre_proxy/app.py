"""The HTTP front (Starlette): Anthropic and OpenAI routes, with or without an `/e/{execution}` prefix,
plus `/gyre/stats` and `/health`.

A request's body is read within `max_body_bytes` (`body.py`), then decoded, checked and rendered through
`Proxy.owned` (on the worker thread when it is large); it is checked whole before anything is run or
recorded (`access.py` says which execution it belongs to and who may ask). A call's engine work lasts only while its client is there
(`disconnect.py`): a client that leaves gets its engine request aborted and nothing recorded. Every error
is answered in the API's own shape (`errors.py`), routing's 404/405 and anything uncaught included; a
stream that already started reports one in-band.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
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
from gyre_proxy.access import execution_of, require_key
from gyre_proxy.body import read_body
from gyre_proxy.control import ControlLink
from gyre_proxy.core import KEPT_BODY_BYTES, CallRun, Proxy
from gyre_proxy.disconnect import while_connected
from gyre_proxy.errors import JSON, Api, ClientLeft, answers_errors, http_exception, stream_error, uncaught

log = logging.getLogger("gyre_proxy.app")
_enc = msgspec.json.Encoder()


class Calls:
    """Running one call for a client: whole (non-streaming) or as a stream, only while it is there."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy

    async def engine_for(self, request: Request, run: CallRun) -> None:
        """Wait (up to `pick_wait_s`) until an engine takes calls of this execution: at once when one
        does (no task, no watcher), else while its client is there."""
        pool = self.proxy.pool
        assert pool is not None
        if pool.active():
            return
        await self._while_connected(request, run, pool.wait_pick(run.ex_id, self.proxy.cfg.pick_wait_s))

    async def whole(self, request: Request, run: CallRun) -> None:
        """Generate and record the call; if the client leaves first, its engine work is aborted."""

        async def work() -> None:
            await run.run()
            await run.finish()

        await self._while_connected(request, run, work())

    async def _while_connected(self, request: Request, run: CallRun, work: Any) -> None:
        try:
            await while_connected(request, work)
        except ClientLeft:
            self.proxy.client_left(run)
            raise

    def stream(self, api: Api, run: CallRun, events: AsyncIterator[bytes]) -> StreamingResponse:
        """A streaming response; Starlette cancels it when the client leaves (aborting the engine work)."""
        proxy = self.proxy

        async def guarded() -> AsyncIterator[bytes]:
            answered = False
            try:
                async for chunk in events:
                    yield chunk
                answered = True
            except Exception as exc:  # the stream already started: the error goes in-band
                log.warning("stream of call %s failed: %s", run.call_id, exc)
                answered = True
                yield stream_error(api, exc)
            finally:
                if not answered:  # cancelled: the client left
                    proxy.client_left(run)

        return StreamingResponse(guarded(), media_type="text/event-stream")


def anthropic_routes(proxy: Proxy, calls: Calls) -> list[Route]:
    keys = proxy.cfg.api_keys
    limit = proxy.cfg.max_body_bytes

    def start(body: bytes, ex: str, headers: Mapping[str, str], t0: float) -> tuple[CallRun, AR.ARequest]:
        """(holding the proxy's state) Decode, check, convert and render the request."""
        earlier = proxy.bodies.get(ex) if len(body) > KEPT_BODY_BYTES else None
        req, conv, decoded = AR.decode_conversation(body, proxy.stripper, proxy.messages, earlier)
        if decoded is not None:
            proxy.bodies.put(ex, len(body), decoded)
        return proxy.start_call(conv, AR.to_sampling(req), ex, headers, t0, len(body)), req

    def count(body: bytes, ex: str) -> int:
        """(holding the proxy's state) The request's input tokens."""
        req = AR.decode(body, count=True)
        return proxy.count_tokens(AR.to_conversation(req, proxy.stripper), ex)

    @answers_errors(Api.ANTHROPIC)
    async def messages(request: Request) -> Response:
        ex = execution_of(keys, request)
        body = await read_body(request, limit)
        run, req = await proxy.owned(len(body), start, body, ex, request.headers, time.perf_counter())
        del body
        await calls.engine_for(request, run)
        if req.stream:
            return calls.stream(Api.ANTHROPIC, run, A.stream_events(run, req.model))
        await calls.whole(request, run)
        return Response(A.message_json(run, req.model), media_type=JSON)

    @answers_errors(Api.ANTHROPIC)
    async def count_tokens(request: Request) -> Response:
        ex = execution_of(keys, request)
        body = await read_body(request, limit)
        n = await proxy.owned(len(body), count, body, ex)
        return Response(_enc.encode({"input_tokens": n}), media_type=JSON)

    @answers_errors(Api.ANTHROPIC)
    async def models(request: Request) -> Response:
        require_key(keys, request)
        name = proxy.cfg.model_name
        m = {
            "type": "model",
            "id": name,
            "display_name": name,
            "created_at": "2026-01-01T00:00:00Z",
            "object": "model",
            "owned_by": "gyre",
        }
        body = {"data": [m], "has_more": False, "first_id": name, "last_id": name, "object": "list"}
        return Response(_enc.encode(body), media_type=JSON)

    return _prefixed(
        [
            ("/v1/messages", messages, "POST"),
            ("/v1/messages/count_tokens", count_tokens, "POST"),
            ("/v1/models", models, "GET"),
        ]
    )


def openai_routes(proxy: Proxy, calls: Calls) -> list[Route]:
    keys = proxy.cfg.api_keys
    limit = proxy.cfg.max_body_bytes
    vocab = proxy.tokenizer.get_vocab_size(with_added_tokens=True)

    def start(body: bytes, ex: str, headers: Mapping[str, str], t0: float) -> tuple[CallRun, OR.ORequest]:
        """(holding the proxy's state) Decode, check, convert and render the request."""
        req = OR.decode(body)
        conv = OR.to_conversation(req, proxy.stripper)
        return proxy.start_call(conv, OR.to_sampling(req, 4096, vocab), ex, headers, t0, len(body)), req

    @answers_errors(Api.OPENAI)
    async def chat_completions(request: Request) -> Response:
        ex = execution_of(keys, request)
        body = await read_body(request, limit)
        run, req = await proxy.owned(len(body), start, body, ex, request.headers, time.perf_counter())
        del body
        await calls.engine_for(request, run)
        lps = bool(req.logprobs)
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return calls.stream(Api.OPENAI, run, O.stream_chunks(run, req.model, usage, lps))
        await calls.whole(request, run)
        return Response(O.completion_json(run, req.model, lps), media_type=JSON)

    return _prefixed([("/v1/chat/completions", chat_completions, "POST")])


def _prefixed(routes: list[tuple[str, Any, str]]) -> list[Route]:
    """Each route plain and under `/e/{execution}`."""
    return [
        Route(f"{prefix}{path}", fn, methods=[method])
        for prefix in ("", "/e/{execution}")
        for path, fn, method in routes
    ]


def stats_body(proxy: Proxy, control: ControlLink | None, by_execution: dict[str, int]) -> dict[str, Any]:
    """`/gyre/stats`; `by_execution`: `Proxy.non_extensions_by_execution()` (read holding the proxy's state)."""
    pool = proxy.pool
    engines = [
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
        for e in (pool.engines.values() if pool is not None else ())
    ]
    s = proxy.stats
    sink = proxy.sink.stats if proxy.sink else None
    return {
        "engines": engines,
        "calls": s.calls,
        "reused_tokens": s.reused_tokens,
        "recorded_tokens": s.recorded_tokens,
        "tokenized_tokens": s.tokenized_tokens,
        "ambiguous_turns": s.ambiguous_turns,
        "appended_calls": s.appended_calls,
        "non_extensions": s.non_extensions,
        "non_extensions_by_execution": by_execution,
        "restored_empty_replies": s.restored_empty_replies,
        "abandoned_calls": s.abandoned_calls,
        "records_unanswered": s.records_unanswered,
        "engine_aborts_sent": pool.aborts_sent if pool is not None else 0,
        "moved_calls": proxy.counters.moved_calls,
        "prefix_moved_calls": proxy.counters.prefix_moved_calls,
        "prefix_moved_tokens": proxy.counters.prefix_moved_tokens,
        "reprefilled_tokens": proxy.counters.reprefilled_tokens,
        "engine_errors": proxy.counters.engine_errors,
        "rebalanced_calls": proxy.counters.rebalanced_calls,
        "prefix_move_s": round(proxy.counters.prefix_move_s, 4),
        "records_written": sink.written if sink else 0,
        "records_pushed": sink.pushed if sink else 0,
        "records_push_dropped": sink.push_dropped if sink else 0,
        "record_write_failures": sink.write_failures if sink else 0,
        "torn_bytes_moved": sink.torn_bytes_moved if sink else 0,
        "control": control.applied if control is not None else [],
    }


def build_app(proxy: Proxy) -> Starlette:
    """The proxy's ASGI app; its lifespan starts the proxy and, with `ProxyConfig.sched`, the control link."""
    links: list[ControlLink] = []

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await proxy.start()
        cfg = proxy.cfg
        if cfg.sched:
            assert proxy.pool is not None
            links.append(ControlLink(cfg.sched, proxy.pool, asyncio.get_running_loop(), cfg.token))
        try:
            yield
        finally:
            for link in links:
                await asyncio.to_thread(link.close)
            await proxy.stop()

    @answers_errors(Api.ANTHROPIC)
    async def stats(request: Request) -> Response:
        require_key(proxy.cfg.api_keys, request)
        by_execution = await proxy.owned(0, proxy.non_extensions_by_execution)
        body = stats_body(proxy, links[0] if links else None, by_execution)
        return Response(_enc.encode(body), media_type=JSON)

    async def health(request: Request) -> Response:
        return Response(b"ok")

    calls = Calls(proxy)
    routes = [
        *anthropic_routes(proxy, calls),
        *openai_routes(proxy, calls),
        Route("/gyre/stats", stats),
        Route("/health", health),
    ]
    handlers: dict[Any, Any] = {404: http_exception, 405: http_exception, Exception: uncaught}
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers)
