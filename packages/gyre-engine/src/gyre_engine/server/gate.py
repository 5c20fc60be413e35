"""The gate in front of every route: the bearer token and the bounds on request bodies (ASGI middleware).

With a token, a request that does not carry it (`gyre_base.token`: SGLang's `--api-key` rule) is answered
401 `{"error": "Unauthorized"}` before its body is read and before routing, so it reaches no route and
does no work. A body longer than its path's bound is 413 in SGLang's error shape and the connection
closes: when its `Content-Length` says so, before any route runs, else as soon as the bytes read pass the
bound (`BodyTooLarge`, raised from `receive` inside the route and answered by its error handling). Either
way the rest of the body is first read and dropped, up to `DRAIN_BYTES`, so that the client (which is
still sending) gets the 413 rather than a reset connection; past that the connection is simply closed.
"""

from __future__ import annotations

from dataclasses import dataclass

from gyre_base.token import UNAUTHORIZED_BODY, authorized, needs_token
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gyre_engine.server.errors import BodyTooLarge, too_large

DRAIN_BYTES = 64 << 20
"""At most this much of a refused body is read (and dropped) before the 413 is sent."""
BULK_PATHS = frozenset({"/update_weights_from_tensor", "/import_prefix"})
"""Paths whose bodies carry weights or KV (base64 safetensors in JSON, a msgpack `KvPrefix`)."""


@dataclass(frozen=True)
class BodyLimits:
    """Longest request body accepted, in bytes: `bulk` on `BULK_PATHS`, `default` everywhere else."""

    default: int
    bulk: int

    def for_path(self, path: str) -> tuple[int, str]:
        """The bound for `path` and the setting that holds it (for the error)."""
        if path in BULK_PATHS:
            return self.bulk, "max_bulk_body_bytes, --max-bulk-body-mb"
        return self.default, "max_body_bytes, --max-body-mb"


class Gate:
    """ASGI middleware: the token check, then the body bound (module docstring)."""

    def __init__(self, app: ASGIApp, token: str, limits: BodyLimits) -> None:
        self.app = app
        self.token = token
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        path = scope["path"]
        if (
            self.token
            and needs_token(scope["method"], path)
            and not authorized(headers.get("authorization"), self.token)
        ):
            await _unauthorized(send)
            return
        limit, setting = self.limits.for_path(scope["path"])
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            if int(declared) <= DRAIN_BYTES:
                await _drain(receive, DRAIN_BYTES)
            await too_large(BodyTooLarge(limit, int(declared), setting, declared=True))(scope, receive, send)
            return
        seen = 0

        async def bounded() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    if message.get("more_body", False):
                        await _drain(receive, DRAIN_BYTES - seen)
                    raise BodyTooLarge(limit, seen, setting, declared=False)
            return message

        await self.app(scope, bounded, send)


async def _drain(receive: Receive, budget: int) -> None:
    """Read and drop the rest of a request body, at most `budget` bytes of it."""
    while budget > 0:
        message = await receive()
        if message["type"] != "http.request":
            return
        budget -= len(message.get("body", b""))
        if not message.get("more_body", False):
            return


async def _unauthorized(send: Send) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(UNAUTHORIZED_BODY))]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": UNAUTHORIZED_BODY})
