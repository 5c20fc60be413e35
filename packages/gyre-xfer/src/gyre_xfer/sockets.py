"""The one place gyre-xfer makes ZeroMQ sockets: finite high-water marks, no linger, loopback by default.

`check_bind` refuses a non-loopback control address unless the caller opts in explicitly.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

import zmq

HWM = 1000


def make_socket(ctx: zmq.Context[zmq.Socket[bytes]], kind: int) -> zmq.Socket[bytes]:
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, HWM)
    s.setsockopt(zmq.RCVHWM, HWM)
    return s


def check_bind(address: str, allow_remote: bool) -> None:
    """Control sockets bind loopback (tcp://127.0.0.1, ::1) or ipc:// unless `allow_remote`."""
    if address.startswith(("ipc://", "inproc://")) or allow_remote:
        return
    host = urlsplit(address).hostname or ""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
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
