"""Token authentication for every ZeroMQ listener of gyre: one rule for binds, CURVE keys derived from a
shared run token, and a ZAP handler that admits only peers holding that token.

`bind(sock, address, token)` is the rule every listener goes through. Beyond loopback without a token it
raises `TokenRequiredError` naming the setting; with a token the socket becomes a CURVE server (every
frame encrypted) whose ZAP handler admits only peers holding the token's client key, so nothing from
anyone else reaches the service's decoder; on loopback without a token it binds as it always did.
Clients call `connect(sock, address, token)`. A token is the listener's own setting or else
`$GYRE_TOKEN` (`resolve_token`). Both keypairs come from it through scrypt and HKDF-SHA256, so anyone
holding the token derives them and nobody else can.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import sys
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import zmq
from zmq.utils import z85

from .errors import XferError

TOKEN_ENV = "GYRE_TOKEN"
"""The environment variable every gyre process reads its run token from when not configured."""
MIN_TOKEN_CHARS = 16
ZAP_DOMAIN = b"gyre"
THREAD_DIED = 70
"""Exit status of a process whose ZAP handler thread died (EX_SOFTWARE)."""

_SALT = b"gyre/zeromq-curve/v1"
_SCRYPT = {"n": 1 << 14, "r": 8, "p": 1}  # 16 MiB, tens of ms: slows guessing a captured handshake

log = logging.getLogger("gyre_xfer.auth")


class AuthError(XferError):
    """A listener or client cannot be set up as the authentication rule requires."""


class TokenRequiredError(AuthError):
    """A bind beyond loopback was asked for without a token."""


class WeakTokenError(AuthError):
    """The token is too short to protect anything."""


class CurveUnavailableError(AuthError):
    """This libzmq was built without CURVE (libsodium)."""


class TokenConflictError(AuthError):
    """Two listeners of one ZeroMQ context were given different tokens (one ZAP handler serves both)."""


# ---- the token -------------------------------------------------------------------------------------------


def resolve_token(configured: str = "") -> str:
    """The run token: `configured` if set, else `$GYRE_TOKEN`, else "" (none). Surrounding whitespace
    (a token file's newline) is not part of it."""
    return (configured or os.environ.get(TOKEN_ENV, "")).strip()


def read_token_file(path: str) -> str:
    """The token held in a file (its first line); for `--token-file` flags, which keep it out of `ps`.
    A file that cannot be read or holds no token is an `AuthError`, never "no token"."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise AuthError(f"cannot read the token file {path}: {exc}") from exc
    token = lines[0].strip() if lines else ""
    if not token:
        raise AuthError(f"the token file {path} holds no token on its first line")
    return token


def new_token() -> str:
    """A fresh random token (256 bits, 43 URL-safe characters)."""
    return secrets.token_urlsafe(32)


@dataclass(frozen=True, repr=False)
class CurveKeys:
    """The two CURVE keypairs of one token, Z85-encoded as libzmq takes them."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


@functools.lru_cache(maxsize=8)
def derive_keys(token: str) -> CurveKeys:
    """Both keypairs of `token`: scrypt(token) is the pseudo-random key, HKDF-Expand (SHA-256) turns it
    into one Curve25519 secret per role, and each public key follows from its secret. Deterministic, so
    every holder of the token derives the same keys."""
    if not zmq.has("curve"):
        raise CurveUnavailableError(
            "this libzmq has no CURVE support; install pyzmq's own wheel (it bundles libsodium)"
        )
    if len(token) < MIN_TOKEN_CHARS:
        raise WeakTokenError(
            f"the token is {len(token)} characters; use at least {MIN_TOKEN_CHARS} "
            f"(`gyre-xfer token` prints a new random one)"
        )
    prk = hashlib.scrypt(token.encode(), salt=_SALT, dklen=32, **_SCRYPT)

    def pair(role: bytes) -> tuple[bytes, bytes]:
        secret = z85.encode(hmac.new(prk, b"gyre curve " + role + b"\x01", hashlib.sha256).digest())
        return zmq.curve_public(secret), secret

    server_public, server_secret = pair(b"server")
    client_public, client_secret = pair(b"client")
    return CurveKeys(server_public, server_secret, client_public, client_secret)


# ---- the rule --------------------------------------------------------------------------------------------


def is_loopback(address: str) -> bool:
    """Whether a ZeroMQ bind address stays on this machine: ipc://, inproc://, or a tcp host that is a
    loopback IP or "localhost". Interface names, "*" and other host names are not."""
    scheme, _, _ = address.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    host = urlsplit(address).hostname or ""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def bind(sock: zmq.Socket[bytes], address: str, token: str = "", setting: str = "token") -> str:
    """Bind a listener under the rule (module docstring) and return the address it bound (port 0 is
    resolved). `token` is the listener's configured token ("" reads `$GYRE_TOKEN`); `setting` names
    where that token is configured, for the error."""
    token = resolve_token(token)
    if token:
        keys = derive_keys(token)
        _zap_for(sock.context, keys)
        sock.curve_server = True
        sock.curve_secretkey = keys.server_secret
        sock.curve_publickey = keys.server_public
        sock.zap_domain = ZAP_DOMAIN
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler answering: refuse, never admit
    elif not is_loopback(address):
        raise TokenRequiredError(
            f"refusing to bind {address} beyond loopback without a token: set {TOKEN_ENV} "
            f"(or this listener's `{setting}` setting) to the run token"
        )
    sock.bind(address)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def connect(sock: zmq.Socket[bytes], address: str, token: str = "") -> None:
    """Connect a client; with a token ("" reads `$GYRE_TOKEN`) it speaks CURVE with the token's keys."""
    token = resolve_token(token)
    if token:
        keys = derive_keys(token)
        sock.curve_serverkey = keys.server_public
        sock.curve_publickey = keys.client_public
        sock.curve_secretkey = keys.client_secret
    sock.connect(address)


# ---- the ZAP handler -------------------------------------------------------------------------------------

_handlers: dict[zmq.Context[zmq.Socket[bytes]], _ZapHandler] = {}
_handlers_lock = threading.Lock()


def _zap_for(ctx: zmq.Context[zmq.Socket[bytes]], keys: CurveKeys) -> None:
    """Make sure `ctx` has a ZAP handler admitting `keys`' client (one per context, as libzmq allows)."""
    with _handlers_lock:
        h = _handlers.get(ctx)
        if h is None:
            _handlers[ctx] = _ZapHandler(ctx, keys.client_public)
        elif not hmac.compare_digest(h.client_public, keys.client_public):
            raise TokenConflictError("listeners of one ZeroMQ context must share one token")


class _ZapHandler:
    """Answers libzmq's ZAP requests (RFC 27) for one context on its own thread: CURVE in gyre's domain
    with the token's client key is admitted, everything else refused and logged. Its socket is not
    tracked by the context, so the owner's `ctx.term()` (or `destroy()`) ends it: the thread sees ETERM,
    closes the socket and leaves. If it dies of anything else the process ends loudly, since a listener
    whose ZAP handler is gone refuses every peer."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], client_public: bytes) -> None:
        self.ctx = ctx
        self.client_public = client_public
        self._client_raw = z85.decode(client_public)
        self._sock: zmq.Socket[bytes] = zmq.Socket(ctx, zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind("inproc://zeromq.zap.01")
        threading.Thread(target=self._run, name="gyre-zap", daemon=True).start()

    def _run(self) -> None:
        try:
            while True:
                try:
                    frames = self._sock.recv_multipart()
                    reply = self.answer(frames)
                    if reply is not None:
                        self._sock.send_multipart(reply)
                except zmq.ContextTerminated:
                    break
        except BaseException:
            _die()
        finally:
            self._sock.close(0)
            with _handlers_lock:
                if _handlers.get(self.ctx) is self:
                    del _handlers[self.ctx]

    def answer(self, frames: list[bytes]) -> list[bytes] | None:
        """The reply to one ZAP request (routing id, empty, version, request id, domain, address,
        identity, mechanism, credentials...), or None when it is too short to answer."""
        if len(frames) < 8:
            return None
        route, empty, version, request_id, domain, address, _identity, mechanism, *cred = frames
        ok = (
            version == b"1.0"
            and domain == ZAP_DOMAIN
            and mechanism == b"CURVE"
            and len(cred) == 1
            and hmac.compare_digest(cred[0], self._client_raw)
        )
        if not ok:
            peer = address.decode(errors="replace")
            log.warning(
                "refused a ZeroMQ peer from %s: not this run's token (%s, domain %r)",
                peer,
                mechanism.decode(errors="replace"),
                domain.decode(errors="replace"),
            )
        status = (b"200", b"OK", b"gyre") if ok else (b"400", b"not this run's token", b"")
        return [route, empty, b"1.0", request_id, *status, b""]


def _die() -> None:
    try:
        sys.stderr.write(f"gyre-xfer: the ZAP handler thread died; the process exits ({THREAD_DIED})\n")
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
    finally:
        os._exit(THREAD_DIED)
