"""The one place gyre-xfer makes ZeroMQ sockets: finite high-water marks, no linger, loopback by default.

Listeners bind through `gyre_xfer.auth.bind` (a token beyond loopback). `check_bind` is the older,
token-less check kept for listeners that have not moved to `auth.bind` yet.
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

import zmq

from .auth import is_loopback

HWM = 1000


def make_socket(ctx: zmq.Context[zmq.Socket[bytes]], kind: int) -> zmq.Socket[bytes]:
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, HWM)
    s.setsockopt(zmq.RCVHWM, HWM)
    return s


def check_bind(address: str, allow_remote: bool) -> None:
    """Control sockets bind loopback (tcp://127.0.0.1, ::1) or ipc:// unless `allow_remote`. Superseded
    by `gyre_xfer.auth.bind`, which allows a non-loopback bind only with a token."""
    if not allow_remote and not is_loopback(address):
        raise ValueError(
            f"refusing to bind control socket {address}: gyre-xfer binds loopback unless "
            "allow_remote=True (and then put it behind a firewall or a private network)"
        )


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
