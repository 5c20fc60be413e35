"""The run token: one secret per run that every gyre listener beyond loopback requires, and the HTTP
bearer check that carries it (standard library only, so torch-free and pyzmq-free clients import it).

A listener's token is its own setting, else `$GYRE_TOKEN` (`resolve_token`); `listener_token` applies the
rule: beyond loopback without a token is `TokenRequiredError` naming the setting, and a token shorter than
`MIN_TOKEN_CHARS` is `WeakTokenError`. Over HTTP the token travels as `Authorization: Bearer <token>`,
checked as SGLang 0.5.23 checks its `--api-key` (`sglang.srt.utils.auth.decide_request_auth`): the scheme
case-insensitively, the key in constant time, `/health*`, `/ready*`, `/metrics*` and `OPTIONS` exempt,
and a refusal is 401 `{"error": "Unauthorized"}`. Over ZeroMQ it keys CURVE (`gyre_base.sockets`).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
from pathlib import Path
from urllib.parse import urlsplit

TOKEN_ENV = "GYRE_TOKEN"
"""The environment variable every gyre process reads its run token from when not configured."""
MIN_TOKEN_CHARS = 16
"""Shorter tokens are refused: they protect nothing."""
OPEN_PATH_PREFIXES = ("/health", "/ready", "/metrics")
"""HTTP paths that need no token (SGLang's list: probes must work without secrets)."""
UNAUTHORIZED_BODY = b'{"error":"Unauthorized"}'
"""SGLang's 401 body, as its middleware writes it."""


class TokenError(ValueError):
    """A listener or client cannot be set up as the token rule requires (an unreadable token file, a
    missing or weak token, a token ZeroMQ cannot use)."""


class TokenRequiredError(TokenError):
    """A listener beyond loopback was asked for without a token."""


class WeakTokenError(TokenError):
    """The token is too short to protect anything."""


# ---- where the token comes from ---------------------------------------------------------------------------


def resolve_token(configured: str = "") -> str:
    """The run token: `configured` if set, else `$GYRE_TOKEN`, else "" (none). Surrounding whitespace
    (a token file's newline) is not part of it."""
    return (configured or os.environ.get(TOKEN_ENV, "")).strip()


def read_token_file(path: str) -> str:
    """The token held in a file (its first line, stripped), for `--token-file` flags that keep it out of
    `ps`. A file that cannot be read or holds no token is a `TokenError`, never "no token"."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenError(f"cannot read the token file {path}: {exc}") from exc
    token = lines[0].strip() if lines else ""
    if not token:
        raise TokenError(f"the token file {path} holds no token on its first line")
    return token


def new_token() -> str:
    """A fresh random token (256 bits, 43 URL-safe characters)."""
    return secrets.token_urlsafe(32)


def check_strength(token: str) -> str:
    """`token`, or `WeakTokenError` when it is shorter than `MIN_TOKEN_CHARS`."""
    if len(token) < MIN_TOKEN_CHARS:
        raise WeakTokenError(
            f"the token is {len(token)} characters; use at least {MIN_TOKEN_CHARS} "
            "(`gyre-base token` prints a new random one)"
        )
    return token


# ---- the loopback rule -------------------------------------------------------------------------------------


def is_loopback_host(host: str) -> bool:
    """Whether a host to listen on stays on this machine: a loopback IP (v4 or v6, bracketed or not) or
    "localhost". "0.0.0.0", "::", "*", interface names and other host names are not."""
    host = host.strip().removeprefix("[").removesuffix("]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def is_loopback_endpoint(address: str) -> bool:
    """Whether a ZeroMQ bind address stays on this machine: ipc://, inproc://, or a tcp:// host that
    `is_loopback_host` accepts."""
    scheme, _, _ = address.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    return is_loopback_host(urlsplit(address).hostname or "")


def listener_token(address: str, configured: str = "", setting: str = "this listener's token setting") -> str:
    """The token a listener at `address` runs with: `configured`, else `$GYRE_TOKEN`; "" for none.
    `address` is a ZeroMQ endpoint (it has "://") or an HTTP host. Beyond loopback without a token:
    `TokenRequiredError` naming `GYRE_TOKEN` and `setting`; a short token: `WeakTokenError`."""
    token = resolve_token(configured)
    if token:
        return check_strength(token)
    loopback = is_loopback_endpoint(address) if "://" in address else is_loopback_host(address)
    if not loopback:
        raise TokenRequiredError(
            f"refusing to bind {address} beyond loopback without a token: set {TOKEN_ENV} "
            f"(or {setting}) to the run token"
        )
    return token


# ---- HTTP: the bearer token --------------------------------------------------------------------------------


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
