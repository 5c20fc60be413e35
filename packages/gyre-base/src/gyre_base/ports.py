"""Ports a process picks for another to listen on (a child it starts, a peer it tells where to bind).

The usual way, binding port 0 and closing the socket, hands out a port from the kernel's ephemeral range
(`net.ipv4.ip_local_port_range`), the range every outgoing connection on the machine takes its local port
from. Between the pick and the child's bind (seconds, while the child imports its libraries) any
connection opened meanwhile may take the port, and the child's bind fails with "address in use": a part
of a run dies at its start. `free_port` picks below that range instead, where the kernel places neither
outgoing connections nor port-0 binds: a random port there that binds now. Only another process picking
the same way can still take it first (about one chance in 12,000 per pair of picks); where the range
leaves too little room below it, the kernel's pick is the fallback.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

PORT_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL = (32768, 60999)
"""Linux's default ephemeral range, where `PORT_RANGE_FILE` cannot be read."""
BELOW = 12000
"""How far below the ephemeral range picks go (not below 10000, past most well-known services)."""
LOWEST = 10000
MIN_ROOM = 1000
"""Fewer free-to-pick ports than this below the range: the kernel's pick instead."""
TRIES = 64

_rng = random.SystemRandom()


def ephemeral_range(path: Path = PORT_RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range (lowest, highest), or Linux's default where it cannot be read."""
    try:
        lo, hi = (int(x) for x in path.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL
    return lo, hi


def binds(host: str, port: int) -> bool:
    """A TCP socket can bind `host:port` now (no listener, no connection, nothing in TIME_WAIT holds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def pick_range(path: Path = PORT_RANGE_FILE) -> tuple[int, int] | None:
    """The ports `free_port` picks from, [start, end), or None where there is too little room."""
    lo, _ = ephemeral_range(path)
    start = max(LOWEST, lo - BELOW)
    return (start, lo) if lo - start >= MIN_ROOM else None


def free_port(host: str = "127.0.0.1", *, path: Path = PORT_RANGE_FILE) -> int:
    """A TCP port on `host` that is free now and that the kernel hands to no other socket meanwhile
    (module docstring): for a process started next to bind."""
    span = pick_range(path)
    if span is not None:
        for _ in range(TRIES):
            port = _rng.randrange(*span)
            if binds(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_ports(host: str, n: int, *, path: Path = PORT_RANGE_FILE) -> list[int]:
    """`n` different ports as `free_port` picks them."""
    out: list[int] = []
    while len(out) < n:
        port = free_port(host, path=path)
        if port not in out:
            out.append(port)
    return out
