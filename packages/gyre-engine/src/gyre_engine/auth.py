"""The engine's HTTP token rule, shared by the server, the client and the SGLang launcher.

A listener bound beyond loopback needs the run token; with a token (on any address) every request but the
health probes must carry `Authorization: Bearer <token>`, which is SGLang 0.5.23's `--api-key` check
(`sglang.srt.utils.auth.decide_request_auth`): the scheme is matched case-insensitively, the key compared
in constant time, `/health*`, `/ready*` and `/metrics*` and `OPTIONS` pass without it, and a refusal is
401 `{"error": "Unauthorized"}`. The token is the listener's own setting or else `$GYRE_TOKEN`, resolved as
`gyre_xfer.auth.resolve_token` resolves it for gyre's ZeroMQ listeners (and a `--token-file` is read as
`gyre_xfer.auth.read_token_file` reads it); the client side cannot import gyre-xfer (it brings pyzmq), so
those few lines are repeated here and `tests/test_auth.py` checks that the two agree.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from pathlib import Path

TOKEN_ENV = "GYRE_TOKEN"
"""The environment variable every gyre process reads the run token from when it is not configured."""
MIN_TOKEN_CHARS = 16
"""Shorter tokens are refused, as gyre-xfer refuses them."""
OPEN_PATH_PREFIXES = ("/health", "/ready", "/metrics")
"""Paths that need no token (SGLang's list: probes must work without secrets)."""
UNAUTHORIZED_BODY = b'{"error":"Unauthorized"}'
"""SGLang's 401 body, as its middleware writes it."""


class TokenError(ValueError):
    """A listener cannot start as the token rule requires."""


class TokenRequiredError(TokenError):
    """A bind beyond loopback without a token."""


class WeakTokenError(TokenError):
    """A token too short to protect anything."""


def resolve_token(configured: str = "") -> str:
    """The run token: `configured` if set, else `$GYRE_TOKEN`, else "" (none); surrounding whitespace
    (a token file's newline) is not part of it."""
    return (configured or os.environ.get(TOKEN_ENV, "")).strip()


def read_token_file(path: str) -> str:
    """The token held in a file (its first line, stripped), for `--token-file` flags that keep it out of
    `ps`. A file that cannot be read or holds no token is a TokenError, never "no token"."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenError(f"cannot read the token file {path}: {exc}") from exc
    token = lines[0].strip() if lines else ""
    if not token:
        raise TokenError(f"the token file {path} holds no token on its first line")
    return token


def is_loopback_host(host: str) -> bool:
    """Whether an HTTP bind address stays on this machine: a loopback IP (v4 or v6, bracketed or not) or
    "localhost". "0.0.0.0", "::", interface addresses and other host names are not."""
    host = host.strip().removeprefix("[").removesuffix("]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def listener_token(host: str, configured: str, setting: str) -> str:
    """The token a listener on `host` runs with (`configured`, else `$GYRE_TOKEN`; "" for none). Beyond
    loopback without one: TokenRequiredError naming `setting` and `GYRE_TOKEN`; a token shorter than
    `MIN_TOKEN_CHARS`: WeakTokenError."""
    token = resolve_token(configured)
    if token and len(token) < MIN_TOKEN_CHARS:
        raise WeakTokenError(
            f"the token is {len(token)} characters; use at least {MIN_TOKEN_CHARS} "
            "(`gyre-xfer token` prints a new random one)"
        )
    if not token and not is_loopback_host(host):
        raise TokenRequiredError(
            f"refusing to listen on {host} beyond loopback without a token: set {TOKEN_ENV} "
            f"(or {setting}) to the run token"
        )
    return token


def bearer(token: str) -> dict[str, str]:
    """The request header that carries `token` ({} without one)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def needs_token(method: str, path: str) -> bool:
    """Whether a request must carry the token when the server has one (SGLang's exemptions)."""
    return method != "OPTIONS" and not path.startswith(OPEN_PATH_PREFIXES)


def authorized(header: str | None, token: str) -> bool:
    """Whether an `Authorization` header value carries `token` as a bearer token (constant time)."""
    if not header:
        return False
    scheme, space, given = header.partition(" ")
    if scheme.lower() != "bearer" or not space:
        return False
    return hmac.compare_digest(given.encode(), token.encode())
