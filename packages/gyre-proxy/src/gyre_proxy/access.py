"""Which execution a call belongs to, and who may ask: the per-execution API keys.

Without keys (a loopback listener), the execution comes from, in order: the path prefix
`/e/{execution}`, `X-Claude-Code-Session-Id`, `X-Gyre-Execution`, else "default". With keys
(`ProxyConfig.api_keys`, required beyond loopback) every call needs one (`x-api-key` or `Authorization:
Bearer`), the key's execution is the call's whatever the harness's headers say, and a path prefix or
`X-Gyre-Execution` naming another execution is refused (403): a key cannot write into another
execution. `/gyre/stats` and `/v1/models` need a valid key too.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from starlette.requests import Request

from gyre_proxy.errors import Forbidden, Unauthorized


def presented_key(request: Request) -> str:
    key = request.headers.get("x-api-key", "")
    auth = request.headers.get("authorization", "")
    if not key and auth.lower().startswith("bearer "):
        key = auth[7:].strip()
    return key


def _lookup(keys: Mapping[str, str], key: str) -> str | None:
    """The execution of `key`, comparing against every configured key in constant time."""
    found = None
    given = key.encode()
    for k, ex in keys.items():
        if hmac.compare_digest(k.encode(), given):
            found = ex
    return found


def key_execution(keys: Mapping[str, str], request: Request) -> str:
    """The execution the request's key binds (Unauthorized without a configured key)."""
    key = presented_key(request)
    bound = _lookup(keys, key) if key else None
    if bound is None:
        raise Unauthorized("invalid x-api-key" if key else "missing API key")
    return bound


def execution_of(keys: Mapping[str, str], request: Request) -> str:
    """The call's execution (module docstring)."""
    path_ex = request.path_params.get("execution", "")
    gyre_ex = request.headers.get("x-gyre-execution", "")
    if keys:
        bound = key_execution(keys, request)
        for claimed in (path_ex, gyre_ex):
            if claimed and claimed != bound:
                raise Forbidden(f"this API key writes to execution {bound!r} only, not {claimed!r}")
        return bound
    return path_ex or request.headers.get("x-claude-code-session-id", "") or gyre_ex or "default"


def require_key(keys: Mapping[str, str], request: Request) -> None:
    """For routes that belong to no execution (/gyre/stats, /v1/models): a valid key when keys are set."""
    if keys:
        key_execution(keys, request)
