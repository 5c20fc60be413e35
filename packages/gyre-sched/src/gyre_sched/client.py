"""How a peer connects to the scheduler: one DEALER with gyre-sched's socket options, authenticated with
the run token when there is one.

Cells, the rollout driver, the trajectory service, the proxy and observers call `dealer(ctx, address,
token)` and then speak protocol.py over it. `token` is the peer's configured run token; empty reads
`$GYRE_TOKEN`; none at all connects as before, which only a loopback scheduler without a token accepts.
"""

from __future__ import annotations

import zmq
from gyre_xfer import auth

SNDHWM = 1000
RCVHWM = 1000


def dealer(ctx: zmq.Context[zmq.Socket[bytes]], address: str, token: str = "") -> zmq.Socket[bytes]:
    """A DEALER connected to the scheduler's ROUTER at `address` (no linger, finite high-water marks)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, SNDHWM)
    sock.setsockopt(zmq.RCVHWM, RCVHWM)
    try:
        auth.connect(sock, address, token)
    except BaseException:
        sock.close(0)
        raise
    return sock
