"""What every route group of the HTTP face shares: a call onto the engine thread awaited with a deadline,
a JSON body read as one protocol struct (an empty body reads as `{}`), and the guard that turns any
exception a handler raises into SGLang's error shape (`errors.error_for`), so the server keeps serving.
Each route group (`generate.py`, `control.py`, `updates.py`, `prefixes.py`, `info.py`) is a class whose
`routes()` lists its paths; `app.py` only assembles them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gyre_engine.server.engine import Engine
from gyre_engine.server.errors import error_for

Handler = Callable[[Request], Awaitable[Response]]


class EngineCalls:
    """Runs functions on the engine thread (`Engine.call`, between two steps) and awaits each with a
    deadline: `control_timeout_s` unless the call gives its own."""

    def __init__(self, engine: Engine, control_timeout_s: float) -> None:
        self.engine = engine
        self.control_timeout_s = control_timeout_s

    async def __call__[T](self, fn: Callable[..., T], *args: Any, timeout: float | None = None) -> T:
        fut = self.engine.call(fn, *args)
        return await asyncio.wait_for(asyncio.wrap_future(fut), timeout or self.control_timeout_s)


async def body_as[M](request: Request, typ: type[M]) -> M:
    """The request's JSON body decoded strictly as `typ`; an empty body is `{}` (every field defaulted)."""
    raw = await request.body()
    return msgspec.json.decode(raw or b"{}", type=typ)


def guarded(handler: Handler) -> Handler:
    """`handler`, with any exception it raises answered in SGLang's error shape."""

    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except Exception as exc:
            return error_for(exc)

    return wrapped


def route(path: str, handler: Handler, *methods: str) -> Route:
    """A guarded route of `path` for `methods`."""
    return Route(path, guarded(handler), methods=list(methods))
