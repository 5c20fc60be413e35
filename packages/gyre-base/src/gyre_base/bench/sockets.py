"""What the run token costs a ZeroMQ link, measured side by side in one run: a DEALER -> ROUTER echo over
loopback TCP with no security (NULL) and with CURVE + ZAP (`gyre_base.sockets`), alternating blocks so
the two see the same machine load; plus key derivation and connection set-up. One JSON object is printed
as the last line (`--out FILE` also writes it). Run: `gyre-base bench [--quick] [--out F]`.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from typing import Any

import zmq

from gyre_base import sockets

TOKEN = "bench-token-0123456789abcdef0123"
PAYLOAD = os.urandom(5000)  # about the size of a gyre-sched State or a snapshot manifest
HWM = 10_000  # the flood keeps 256 in flight: far below it


class Echo:
    """A ROUTER on its own context and thread that sends every message back."""

    def __init__(self, token: str) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = sockets.make_socket(self.ctx, zmq.ROUTER, hwm=HWM)
        self.address = sockets.bind(self.sock, "tcp://127.0.0.1:0", token)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while not self.stop.is_set():
            if self.sock.poll(50):
                for _ in range(1000):
                    try:
                        self.sock.send_multipart(self.sock.recv_multipart(zmq.NOBLOCK))
                    except zmq.Again:
                        break

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()


def _client(ctx: zmq.Context[zmq.Socket[bytes]], address: str, token: str) -> zmq.Socket[bytes]:
    return sockets.connected(ctx, zmq.DEALER, address, token, hwm=HWM)


def _round_trips(sock: zmq.Socket[bytes], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        sock.send(PAYLOAD)
        sock.recv()
        out.append(time.perf_counter() - t0)
    return out


def _throughput(sock: zmq.Socket[bytes], n: int, window: int = 256) -> float:
    """Messages per second echoed with `window` in flight."""
    t0 = time.perf_counter()
    sent = got = 0
    while got < n:
        while sent < n and sent - got < window:
            sock.send(PAYLOAD)
            sent += 1
        sock.recv()
        got += 1
    return n / (time.perf_counter() - t0)


def _connect_s(ctx: zmq.Context[zmq.Socket[bytes]], address: str, token: str) -> float:
    """From connect to the first echo (TCP set-up, handshake, ZAP for CURVE)."""
    t0 = time.perf_counter()
    s = _client(ctx, address, token)
    s.send(b"x")
    s.recv()
    dt = time.perf_counter() - t0
    s.close(0)
    return dt


def run(quick: bool) -> dict[str, Any]:
    blocks, per_block, flood, connects = (4, 250, 5_000, 10) if quick else (10, 500, 20_000, 30)
    derive = []
    for _ in range(3 if quick else 7):
        sockets.derive_keys.cache_clear()
        t0 = time.perf_counter()
        sockets.derive_keys(TOKEN)
        derive.append(time.perf_counter() - t0)
    servers = {"null": Echo(""), "curve": Echo(TOKEN)}
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    tokens = {"null": "", "curve": TOKEN}
    try:
        socks = {k: _client(ctx, servers[k].address, tokens[k]) for k in servers}
        for k in socks:
            _round_trips(socks[k], 50)  # warm up
        rtt: dict[str, list[float]] = {k: [] for k in socks}
        rate: dict[str, list[float]] = {k: [] for k in socks}
        conn: dict[str, list[float]] = {k: [] for k in socks}
        for _ in range(blocks):  # alternate so both see the same load
            for k in socks:
                rtt[k] += _round_trips(socks[k], per_block)
                rate[k].append(_throughput(socks[k], flood // blocks))
                conn[k] += [
                    _connect_s(ctx, servers[k].address, tokens[k]) for _ in range(connects // blocks or 1)
                ]
        for s in socks.values():
            s.close(0)
    finally:
        ctx.term()
        for srv in servers.values():
            srv.close()

    def us(xs: list[float], q: float) -> float:
        return round(statistics.quantiles(xs, n=100)[int(q) - 1] * 1e6, 1)

    r: dict[str, Any] = {"payload_bytes": len(PAYLOAD), "quick": quick}
    for k in ("null", "curve"):
        r[f"{k}_rtt_p50_us"] = us(rtt[k], 50)
        r[f"{k}_rtt_p99_us"] = us(rtt[k], 99)
        r[f"{k}_msgs_per_s_256_in_flight"] = round(statistics.median(rate[k]))
        r[f"{k}_connect_to_first_reply_ms"] = round(statistics.median(conn[k]) * 1e3, 2)
    r["curve_over_null_rtt_p50"] = round(r["curve_rtt_p50_us"] / r["null_rtt_p50_us"], 3)
    r["curve_over_null_msgs_per_s"] = round(
        r["curve_msgs_per_s_256_in_flight"] / r["null_msgs_per_s_256_in_flight"], 3
    )
    r["derive_keys_ms"] = round(statistics.median(derive) * 1e3, 1)
    r["load_average_1min"] = round(os.getloadavg()[0], 2)
    return r


def main(quick: bool, out: str | None) -> None:
    """Run, print the JSON object as the last line, and also write it (indented) to `out`."""
    r = run(quick)
    if out:
        with open(out, "w") as f:
            json.dump(r, f, indent=1)
            f.write("\n")
    print(json.dumps(r))
