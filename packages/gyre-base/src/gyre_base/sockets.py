"""ZeroMQ sockets for gyre: made one way (no linger, finite high-water marks), bound and connected under
the run token's rule. Needs pyzmq: `pip install 'gyre-base[zmq]'`.

`bind(sock, address, token, setting)` is the rule every listener goes through: beyond loopback without a
token it raises `TokenRequiredError` naming the setting; with a token the socket becomes a CURVE server
(every frame encrypted) whose ZAP handler admits only peers holding the token's client key, so nothing
from anyone else reaches the service's decoder; on loopback without a token it binds plainly. Clients
call `connect(sock, address, token)` (or `connected(ctx, kind, address, token)`). Both keypairs come from
the token through scrypt and HKDF-SHA256, so anyone holding it derives them and nobody else can.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import os
import socket
import sys
import threading
import traceback
from dataclasses import dataclass
from urllib.parse import urlsplit

try:
    import zmq
    from zmq.utils import z85
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        f"gyre_base.sockets needs pyzmq, which is not installed ({exc}): pip install 'gyre-base[zmq]'"
    ) from exc

from gyre_base.token import TokenError, check_strength, listener_token, resolve_token

HWM = 1000
"""Default send and receive high-water mark (messages): finite, so a slow peer pushes back."""
ZAP_DOMAIN = b"gyre"
THREAD_DIED = 70
"""Exit status of a process whose ZAP handler thread died (EX_SOFTWARE)."""

_SALT = b"gyre/zeromq-curve/v1"
_SCRYPT = {"n": 1 << 14, "r": 8, "p": 1}  # 16 MiB, tens of ms: slows guessing a captured handshake

log = logging.getLogger("gyre_base.sockets")

Context = zmq.Context[zmq.Socket[bytes]]


class CurveUnavailableError(TokenError):
    """This libzmq was built without CURVE (libsodium), so a token cannot be used."""


class TokenConflictError(TokenError):
    """Two listeners of one ZeroMQ context were given different tokens (one ZAP handler serves both)."""


# ---- making sockets ----------------------------------------------------------------------------------------


def make_socket(ctx: Context, kind: int, hwm: int = HWM) -> zmq.Socket[bytes]:
    """A socket of `kind` that drops unsent messages on close and queues at most `hwm` each way."""
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, hwm)
    s.setsockopt(zmq.RCVHWM, hwm)
    return s


def connected(ctx: Context, kind: int, address: str, token: str = "", hwm: int = HWM) -> zmq.Socket[bytes]:
    """`make_socket(ctx, kind, hwm)` connected to `address` with `token` (`connect`); closed again if
    the connect fails."""
    s = make_socket(ctx, kind, hwm)
    try:
        connect(s, address, token)
    except BaseException:
        s.close(0)
        raise
    return s


def tcp_port_refuses(address: str, timeout_s: float = 0.5) -> bool:
    """True when a tcp:// address actively refuses connections (its process is gone)."""
    parts = urlsplit(address)
    if parts.scheme != "tcp" or parts.hostname is None or parts.port is None:
        return False
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


# ---- the keys ----------------------------------------------------------------------------------------------


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
    check_strength(token)
    prk = hashlib.scrypt(token.encode(), salt=_SALT, dklen=32, **_SCRYPT)

    def pair(role: bytes) -> tuple[bytes, bytes]:
        secret = z85.encode(hmac.new(prk, b"gyre curve " + role + b"\x01", hashlib.sha256).digest())
        return zmq.curve_public(secret), secret

    server_public, server_secret = pair(b"server")
    client_public, client_secret = pair(b"client")
    return CurveKeys(server_public, server_secret, client_public, client_secret)


# ---- the rule ----------------------------------------------------------------------------------------------


def bind(sock: zmq.Socket[bytes], address: str, token: str = "", setting: str = "its token setting") -> str:
    """Bind a listener under the rule (module docstring) and return the address it bound (port 0 is
    resolved). `token` is the listener's configured token ("" reads `$GYRE_TOKEN`); `setting` names
    where that token is configured, for the error."""
    token = listener_token(address, token, setting)
    if token:
        keys = derive_keys(token)
        _zap_for(sock.context, keys)
        sock.curve_server = True
        sock.curve_secretkey = keys.server_secret
        sock.curve_publickey = keys.server_public
        sock.zap_domain = ZAP_DOMAIN
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler answering: refuse, never admit
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


# ---- the ZAP handler ---------------------------------------------------------------------------------------

_handlers: dict[Context, _ZapHandler] = {}
_handlers_lock = threading.Lock()


def _zap_for(ctx: Context, keys: CurveKeys) -> None:
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

    def __init__(self, ctx: Context, client_public: bytes) -> None:
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
        sys.stderr.write(f"gyre: the ZAP handler thread died; the process exits ({THREAD_DIED})\n")
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
    finally:
        os._exit(THREAD_DIED)
