"""/generate and the health probe: request bodies in, engine rows, SGLang responses out.

Nothing slow runs on the event loop. A body with `text` is first measured (a text longer in bytes than
the context could hold, whatever its tokens, is refused without tokenizing), then tokenized on a thread
of its own; a large `input_ids` body is parsed and checked on a worker thread. No generation outlives its
client: a plain call watches its connection and, when the client leaves, is cancelled and its rows
aborted; a stream is cancelled the same way by Starlette when its client leaves, and its rows aborted.
Aborts name the request object itself, so a new request that reuses the rid is never hit.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from gyre_engine.protocol import ErrorBody, GenerateRequest, GenerateResponse, ProtocolError, SamplingParams
from gyre_engine.server.engine import Engine
from gyre_engine.server.errors import ClientGone, json_response
from gyre_engine.server.parse import is_single, parse_generate
from gyre_engine.server.request import EngineRequest, TokenEvent
from gyre_engine.server.response import ResponseBuilder
from gyre_engine.server.routing import route

_json = msgspec.json.Encoder()

TEXT_BYTES_SLACK = 4
"""A normalizer may shrink text before it is split into tokens (NFC or NFKC: at most 3 bytes into 1), so
a text is refused unread only past this many times the longest token's bytes per context position."""
INLINE_PARSE_BYTES = 256 << 10
"""`input_ids` bodies up to this size are parsed and checked on the event loop (a 40k-token prompt is
about 250 KiB); larger ones on a worker thread."""


async def until_disconnected(request: Request) -> None:
    """Returns once the client of `request` has gone (its body already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_client_leaves[T](request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; if the client disconnects first, `work` is cancelled (its rows aborted on the
    way out) and ClientGone is raised."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone("the client closed the connection; its generation was aborted")
    return task.result()


async def all_or_none[T](work: list[Awaitable[T]]) -> list[T]:
    """The results of `work`, run together; the first failure (or cancellation) cancels the rest, and
    every one has ended (rows aborted) before this returns or raises."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def max_token_bytes(tokenizer: Any) -> int:
    """The most UTF-8 bytes any one token of `tokenizer` decodes to (a byte that is not valid UTF-8 alone
    decodes to U+FFFD, 3 bytes, which only overstates it)."""
    pieces = tokenizer.batch_decode(
        [[i] for i in range(len(tokenizer))], skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    return max(1, *(len(p.encode()) for p in pieces))


def event_sink(loop: asyncio.AbstractEventLoop, q: asyncio.Queue[TokenEvent]) -> Callable[[TokenEvent], None]:
    """What the engine thread calls with each of a request's events: hands it to `q` on `loop`. Once the
    loop is closed (the server shutting down with the request still running) nobody reads the events:
    they are dropped, where handing them over would raise on the engine thread for every such request."""

    def sink(ev: TokenEvent) -> None:
        try:
            loop.call_soon_threadsafe(q.put_nowait, ev)
        except RuntimeError:
            if not loop.is_closed():
                raise

    return sink


class GenerateRoutes:
    """The handlers of /generate and /health(_generate) over one engine."""

    def __init__(
        self, engine: Engine, request_timeout_s: float, control_timeout_s: float, health_timeout_s: float
    ) -> None:
        self.engine = engine
        self.tok = engine.tokenizer
        self.request_timeout_s = request_timeout_s
        self.control_timeout_s = control_timeout_s
        self.health_timeout_s = health_timeout_s
        self.token_bytes = max_token_bytes(self.tok) if self.tok is not None else 1
        """The most bytes of text one token can stand for (`max_token_bytes`)."""
        self._tokenizing = ThreadPoolExecutor(1, thread_name_prefix="gyre-tokenize")

    def close(self) -> None:
        self._tokenizing.shutdown(wait=False, cancel_futures=True)

    def routes(self) -> list[Route]:
        return [
            route("/generate", self.generate, "POST"),
            route("/health", self.health_generate, "GET"),
            route("/health_generate", self.health_generate, "GET"),
        ]

    # ------------------------------------------------------------------ parsing
    def _tokenize(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def _check_text_sizes(self, texts: list[str]) -> None:
        if self.tok is None:
            raise ProtocolError("text input needs a tokenizer; this engine has none: send input_ids")
        per_token = TEXT_BYTES_SLACK * self.token_bytes
        for t in texts:
            n = len(t.encode())
            if n > per_token * self.engine.context_len:  # cannot fit, whatever its tokens
                least = n // per_token
                raise ProtocolError(
                    f"The input (at least {least} tokens: {n} bytes of text) is longer than the model's "
                    f"context length ({self.engine.context_len} tokens)."
                )

    def _requests(self, req: GenerateRequest) -> list[EngineRequest]:
        ers = parse_generate(req, self._tokenize, self.engine.context_len)
        for er in ers:
            self.engine.check_request(er)
        return ers

    async def parse(self, req: GenerateRequest, body_bytes: int) -> list[EngineRequest]:
        """The engine requests of a /generate body, checked; tokenizing and large bodies off the loop."""
        if req.text is not None and req.input_ids is None:
            self._check_text_sizes([req.text] if isinstance(req.text, str) else list(req.text))
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._tokenizing, self._requests, req)
        if body_bytes > INLINE_PARSE_BYTES:
            return await asyncio.to_thread(self._requests, req)
        return self._requests(req)

    # ------------------------------------------------------------------ running
    def _abort(self, er: EngineRequest) -> None:
        self.engine.call(self.engine.abort_request, er, "client disconnected")

    async def start(self, er: EngineRequest) -> asyncio.Queue[TokenEvent]:
        """Submit `er`; its events arrive on the queue. Cancelled or refused: nothing is left running."""
        q: asyncio.Queue[TokenEvent] = asyncio.Queue()
        fut = self.engine.submit(er, event_sink(asyncio.get_running_loop(), q))
        try:
            await asyncio.wait_for(asyncio.wrap_future(fut), self.control_timeout_s)
        except BaseException:
            self._abort(er)  # admitted after all (or about to be): free its row
            raise
        return q

    async def events(self, er: EngineRequest, q: asyncio.Queue[TokenEvent]) -> AsyncGenerator[TokenEvent]:
        finished = False
        try:
            while not finished:
                ev = await asyncio.wait_for(q.get(), self.request_timeout_s)
                finished = ev.finish is not None
                yield ev
        finally:
            if not finished:  # the client went away or timed out: free the engine's row
                self._abort(er)

    async def complete(self, er: EngineRequest) -> GenerateResponse:
        q = await self.start(er)
        rb = ResponseBuilder(er, self.tok)
        async with contextlib.aclosing(self.events(er, q)) as evs:
            async for ev in evs:
                rb.add(ev)
        return rb.response()

    def _sse(self, er: EngineRequest, q: asyncio.Queue[TokenEvent]) -> AsyncIterator[bytes]:
        async def chunks() -> AsyncIterator[bytes]:
            rb = ResponseBuilder(er, self.tok)
            try:
                async with contextlib.aclosing(self.events(er, q)) as evs:
                    async for ev in evs:
                        rb.add(ev)
                        if rb.chunk_due():
                            yield b"data: " + _json.encode(rb.response()) + b"\n\n"
            except Exception as exc:  # the stream already started: report in-band, SGLang-style
                body = ErrorBody(str(exc), type(exc).__name__, 500, retryable=True)
                yield b"data: " + _json.encode({"error": body}) + b"\n\n"
            yield b"data: [DONE]\n\n"

        return chunks()

    # ------------------------------------------------------------------ routes
    async def generate(self, request: Request) -> Response:
        raw = await request.body()
        req = msgspec.json.decode(raw or b"{}", type=GenerateRequest)
        ers = await unless_client_leaves(request, self.parse(req, len(raw)))
        if req.stream:
            er = ers[0]
            q = await unless_client_leaves(request, self.start(er))
            # the stream's own exit aborts the row; `background` also covers a client that leaves
            # before the first chunk is asked for (the generator never starts, so it cannot)
            after = BackgroundTask(self._abort, er)
            return StreamingResponse(self._sse(er, q), media_type="text/event-stream", background=after)
        results = await unless_client_leaves(request, all_or_none([self.complete(er) for er in ers]))
        return json_response(results[0] if is_single(req) else results)

    async def health_generate(self, request: Request) -> Response:
        engine = self.engine
        if not engine.alive or engine.released or engine.paused or engine.updating:
            return Response(b"", status_code=503)
        er = EngineRequest(
            f"HEALTH_CHECK_{uuid.uuid4().hex}", [0], SamplingParams(max_new_tokens=1, temperature=0.0)
        )
        try:
            resp = await asyncio.wait_for(self.complete(er), self.health_timeout_s)
        except Exception:
            return Response(b"", status_code=503)
        ok = resp.meta_info.finish_reason is not None and resp.meta_info.finish_reason.type != "abort"
        return Response(b"", status_code=200 if ok else 503)
