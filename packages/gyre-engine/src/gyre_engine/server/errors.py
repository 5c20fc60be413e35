"""Every error the engine's HTTP face answers, in the shape SGLang 0.5.23 answers it.

A refused request is `{"error": {"message", "type", "code", "retryable"}}` (SGLang's `{"error":
{"message"}}` plus fields); a body that is not JSON or does not fit the endpoint's schema is FastAPI's
validation error as SGLang rewrites it, 400 `{"object": "error", "message", "type": "Bad Request",
"param": null, "code": 400}`; a control call SGLang refuses is `{"success": false, "message"}`; an unknown
path or a wrong method is FastAPI's `{"detail": "Not Found"}` / `{"detail": "Method Not Allowed"}` (with
`Allow`); a missing or wrong token is SGLang's 401 `{"error": "Unauthorized"}` (`gyre_base.token`). Each
is checked against SGLang's recorded replies (`tests/fixtures/sglang-0.5.23`: `error_malformed_json`,
`unknown_route`, `wrong_method_generate`, `unauthorized_no_key`). Exceptions map to statuses by type in
`error_for`; anything unforeseen is a 500 in the first shape, logged.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import msgspec
from gyre_xfer.errors import XferError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from gyre_engine.protocol import CUDA_IPC_UNREACHABLE, ErrorBody, ErrorReply, ProtocolError, SuccessReply
from gyre_engine.server.cuda_ipc import CudaIpcUnreachable
from gyre_engine.server.dist_update import DistUpdateError, GroupBusy
from gyre_engine.server.engine import EngineUnavailable
from gyre_engine.server.kv_transfer import KvTransferError
from gyre_engine.server.weights import WeightUpdateError
from gyre_engine.server.xfer import KvPullError, xfer_status
from gyre_engine.weight_group import WeightGroupError, WeightGroupTimeout

log = logging.getLogger(__name__)
_json = msgspec.json.Encoder()


class BodyTooLarge(Exception):
    """A request body past the server's bound for its path (`server/gate.py`)."""

    def __init__(self, limit: int, size: int, setting: str, declared: bool) -> None:
        how = "declared" if declared else "read before stopping"
        super().__init__(
            f"request body too large: {size} bytes {how}, over this server's limit of {limit} bytes "
            f"({setting})"
        )
        self.limit = limit


class ClientGone(Exception):
    """The client closed the connection before its answer was ready; its work was aborted."""


class ValidationErrorReply(msgspec.Struct, frozen=True):
    """SGLang's answer to a body its schema refuses (its `ErrorResponse`, from `RequestValidationError`)."""

    message: str
    object: str = "error"
    type: str = "Bad Request"
    param: str | None = None
    code: int = 400


def json_response(obj: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    return Response(_json.encode(obj), status_code=status, media_type="application/json", headers=headers)


def error_response(
    message: str,
    status: int = 400,
    err_type: str = "BadRequestError",
    retryable: bool = False,
    headers: dict[str, str] | None = None,
) -> Response:
    return json_response(ErrorReply(ErrorBody(message, err_type, status, retryable)), status, headers)


def refused(message: str) -> Response:
    """A control call SGLang refuses answers 400 `{"success": false, "message"}`."""
    return json_response(SuccessReply(False, message), 400)


def too_large(exc: BodyTooLarge) -> Response:
    """413, and the connection closes: the rest of the body is not read."""
    return error_response(str(exc), 413, "PayloadTooLarge", headers={"connection": "close"})


def error_for(exc: Exception) -> Response:
    """The response for an exception a route raised."""
    if isinstance(exc, BodyTooLarge):
        return too_large(exc)
    if isinstance(exc, ClientGone | ClientDisconnect):  # nobody reads this answer
        return error_response(
            str(exc) or "the client left before its body arrived", 499, "ClientClosedRequest"
        )
    if isinstance(exc, CudaIpcUnreachable):  # the client can release the offer and make it another way
        return error_response(str(exc), 409, CUDA_IPC_UNREACHABLE)
    if isinstance(exc, KvPullError):
        return error_response(str(exc), exc.status, "KvTransferFailed", retryable=True)
    if isinstance(exc, XferError):
        status, err_type, retry = xfer_status(exc)
        return error_response(f"{err_type}: {exc}", status, err_type, retryable=retry)
    if isinstance(exc, EngineUnavailable):
        return error_response(str(exc), 409, "EngineUnavailable", retryable=True)
    if isinstance(exc, GroupBusy):
        return error_response(str(exc), 409, "WeightGroupBusy", retryable=True)
    if isinstance(exc, WeightGroupTimeout):
        return error_response(str(exc), 504, "WeightGroupTimeout", retryable=True)
    if isinstance(exc, WeightGroupError):
        return error_response(str(exc), 502, "WeightGroupError", retryable=True)
    if isinstance(exc, msgspec.ValidationError | msgspec.DecodeError):
        return json_response(ValidationErrorReply(str(exc)), 400)
    if isinstance(exc, ProtocolError | WeightUpdateError | KvTransferError | DistUpdateError):
        return error_response(str(exc))
    if isinstance(exc, TimeoutError):
        return error_response(f"timed out: {exc}", 504, "Timeout", retryable=True)
    log.exception("internal error", exc_info=exc)
    return error_response(f"internal error: {exc!r}", 500, "InternalServerError")


async def http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's routing errors (404, 405) as FastAPI, and so SGLang, answers them."""
    assert isinstance(exc, HTTPException)
    return json_response({"detail": exc.detail}, exc.status_code, exc.headers)


async def unhandled(request: Request, exc: Exception) -> Response:
    """Last resort (an exception outside every route's handling): a 500 in SGLang's error shape."""
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(f"internal error: {exc!r}", 500, "InternalServerError")
