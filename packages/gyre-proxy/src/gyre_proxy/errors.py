"""Every error the proxy answers, in the shape of the API the client speaks: one table from exception types
to (status, error type), for the Anthropic Messages API and the OpenAI Chat Completions API.

Anthropic: `{"type": "error", "error": {"type", "message"}}`; OpenAI: `{"error": {"message", "type",
"param", "code"}}`. A route's handler is wrapped by `answers_errors(Api.X)`; routes that do not exist and
methods a route does not take (404, 405) are answered in the shape their path suggests (`api_of_path`),
and so is any exception nothing else caught (500, logged with its traceback). A stream that already
started reports its error in-band (`stream_error`).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from gyre_proxy.body import BodyTooLarge
from gyre_proxy.chat import RequestError
from gyre_proxy.engines import NoEngine
from gyre_proxy.generation import EngineRejected, GenerationFailed
from gyre_proxy.render import ContextTooLong
from gyre_proxy.sink import RecordWriteFailed

log = logging.getLogger("gyre_proxy.errors")
_enc = msgspec.json.Encoder()
JSON = "application/json"


class Api(enum.Enum):
    ANTHROPIC = "anthropic"
    OPENAI = "openai"


class Unauthorized(Exception):
    """No API key, or one that is not configured (401)."""


class Forbidden(Exception):
    """The API key is valid but does not give access to what was asked (403): another execution."""


class ClientLeft(Exception):
    """The client disconnected before its answer was ready; its engine work was aborted. Nobody reads
    the answer (499, as web servers log a client that closed its request)."""


@dataclass(frozen=True)
class Kind:
    status: int
    anthropic: str
    openai: str


_INVALID = Kind(400, "invalid_request_error", "invalid_request_error")
_TABLE: list[tuple[type[BaseException], Kind]] = [
    (RequestError, _INVALID),
    (EngineRejected, _INVALID),
    (Unauthorized, Kind(401, "authentication_error", "invalid_request_error")),
    (Forbidden, Kind(403, "permission_error", "permission_error")),
    (ContextTooLong, Kind(413, "request_too_large", "invalid_request_error")),
    (BodyTooLarge, Kind(413, "request_too_large", "invalid_request_error")),
    (NoEngine, Kind(529, "overloaded_error", "server_error")),  # harnesses retry these
    (GenerationFailed, Kind(529, "overloaded_error", "server_error")),
    (RecordWriteFailed, Kind(500, "api_error", "server_error")),
    (ClientLeft, Kind(499, "api_error", "server_error")),
]
_INTERNAL = Kind(500, "api_error", "server_error")
_BY_STATUS = {
    404: Kind(404, "not_found_error", "invalid_request_error"),
    405: Kind(405, "invalid_request_error", "invalid_request_error"),
}


def kind_of(exc: BaseException) -> Kind:
    return next((k for tp, k in _TABLE if isinstance(exc, tp)), _INTERNAL)


def body(api: Api, kind: Kind, message: str, param: str | None = None) -> bytes:
    if api is Api.ANTHROPIC:
        return _enc.encode({"type": "error", "error": {"type": kind.anthropic, "message": message}})
    return _enc.encode({"error": {"message": message, "type": kind.openai, "param": param, "code": None}})


def error_response(api: Api, exc: BaseException) -> Response:
    kind = kind_of(exc)
    status = kind.status
    if api is Api.OPENAI and status == 529:
        status = 503  # OpenAI's clients know 503, not Anthropic's 529
    message, param = _message(exc)
    if kind is _INTERNAL:
        log.error("internal error answering a request", exc_info=exc)
    return Response(body(api, kind, message, param), status, media_type=JSON)


def _message(exc: BaseException) -> tuple[str, str | None]:
    if isinstance(exc, RequestError):
        return f"{exc.field}: {exc.message}", exc.field
    if isinstance(exc, EngineRejected):
        return f"the engine refused the request: {exc}", None
    if isinstance(exc, ContextTooLong):
        return str(exc), "messages"
    if kind_of(exc) is _INTERNAL:
        return f"internal error ({type(exc).__name__}); the proxy's log has the details", None
    return str(exc), None


def stream_error(api: Api, exc: BaseException) -> bytes:
    """The in-band error event of a stream that already started."""
    kind = kind_of(exc)
    message, param = _message(exc)
    if api is Api.ANTHROPIC:
        return b"event: error\ndata: " + body(api, kind, message) + b"\n\n"
    return b"data: " + body(api, kind, message, param) + b"\n\n"


Handler = Callable[[Request], Awaitable[Response]]


def answers_errors(api: Api) -> Callable[[Handler], Handler]:
    """Wrap a route so every exception it raises is answered in `api`'s error shape."""

    def deco(fn: Handler) -> Handler:
        async def wrapped(request: Request) -> Response:
            try:
                return await fn(request)
            except Exception as exc:
                return error_response(api, exc)

        return wrapped

    return deco


def api_of_path(path: str) -> Api:
    """Which API a path belongs to (for 404/405 and uncaught errors): OpenAI's routes are
    `.../chat/completions` and its other `/v1/...` resources; everything else answers as Anthropic."""
    openai = ("/chat/", "/completions", "/embeddings", "/responses")
    return Api.OPENAI if any(p in path for p in openai) else Api.ANTHROPIC


async def http_exception(request: Request, exc: Exception) -> Response:
    """404 / 405 from routing, in the path's API shape."""
    assert isinstance(exc, HTTPException)
    kind = _BY_STATUS.get(
        exc.status_code, Kind(exc.status_code, "invalid_request_error", "invalid_request_error")
    )
    what = "not found" if exc.status_code == 404 else "method not allowed"
    msg = f"{request.method} {request.url.path}: {what}"
    headers = dict(exc.headers or {})
    return Response(body(api_of_path(request.url.path), kind, msg), exc.status_code, headers, JSON)


async def uncaught(request: Request, exc: Exception) -> Response:
    """Anything no route caught: a 500 in the path's API shape (the traceback goes to the log)."""
    return error_response(api_of_path(request.url.path), exc)
