"""Reading a request's body within the proxy's bound (`ProxyConfig.max_body_bytes`).

A body longer than the bound is refused with `BodyTooLarge` (a 413 in the API's error shape) before any
of it is parsed: at once when its `Content-Length` says so, else as soon as the bytes received pass the
bound, so a huge body is never held whole. The HTTP server reads the rest of a refused body and throws
it away (nothing of it is kept), so a client that sends its body whole before it reads still gets its
413 rather than a reset connection.
"""

from __future__ import annotations

from starlette.requests import Request


class BodyTooLarge(ValueError):
    """A request body longer than the proxy takes (413)."""

    def __init__(self, limit: int, size: int | None = None) -> None:
        got = f"{size} bytes" if size is not None else f"more than {limit} bytes"
        super().__init__(f"request body is {got}; this proxy takes at most {limit} bytes (max_body_bytes)")
        self.limit = limit


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, if it is at most `limit` bytes (else `BodyTooLarge`, having read at most about
    `limit` bytes of it)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit, int(declared))
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        parts.append(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)
