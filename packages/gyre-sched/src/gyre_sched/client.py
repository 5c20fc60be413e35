"""How a peer connects to the scheduler: one DEALER with gyre-sched's socket options, authenticated with
the run token when there is one.

Cells, the rollout driver, the trajectory service, the proxy and observers call `dealer(ctx, address,
token)` and then speak protocol.py over it. `token` is the peer's configured run token; empty reads
`$GYRE_TOKEN`; none at all connects as before, which only a loopback scheduler without a token accepts.
"""

from __future__ import annotations

import zmq
from gyre_base.sockets import connected


def dealer(ctx: zmq.Context[zmq.Socket[bytes]], address: str, token: str = "") -> zmq.Socket[bytes]:
    """A DEALER connected to the scheduler's ROUTER at `address` (no linger, finite high-water marks)."""
    return connected(ctx, zmq.DEALER, address, token)
