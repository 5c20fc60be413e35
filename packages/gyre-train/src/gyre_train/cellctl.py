"""The in-cell control link between a cell's rank 0 and its other ranks (ZeroMQ, msgspec; bulk tensors
go through torch.distributed, never here).

Rank 0 binds three sockets: a ROUTER for the commands of its training thread ("work": compute a round,
apply, publish, gather, stop), a ROUTER for its server thread's gradient reads ("fetch", so reading a
satellite's gradient never waits behind a computation), and a PUB on which a helper thread says it is
alive every `heartbeat_s`. Each other rank connects a DEALER to each ROUTER (identity `rank-<r>`) and a
SUB to the PUB. Rank 0 sends a command to every rank and waits for every reply with a deadline
(`RankSilentError` past it); a rank that hears no heartbeat for `dead_after_s` ends its process (status
70), so a dead rank 0 never leaves the others waiting forever.

The three sockets bind through `gyre_base.sockets.bind` with the cell's run token (`ParallelConfig.token`,
else `$GYRE_TOKEN`): a `control_host` beyond loopback needs one, and with one only ranks holding it are
heard (CURVE + ZAP). Every rank has its own copy of the setting; the token never crosses the link.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import zmq
from gyre_base.sockets import bind, connect, make_socket

from gyre_train.protocol import (
    CellCommand,
    RankFailure,
    RankHello,
    RankReply,
    cell_command_decoder,
    rank_reply_decoder,
)
from gyre_train.threads import THREAD_DIED, start_thread


class RankSilentError(RuntimeError):
    """A rank did not answer a command within the deadline (dead, or stuck in a collective)."""


class RankFailedError(RuntimeError):
    """Another rank of the cell failed a command (its reason is in the message)."""


class LinkAddresses(msgspec.Struct, frozen=True, array_like=True):
    work: str
    fetch: str
    beat: str


def _identity(rank: int) -> bytes:
    return f"rank-{rank}".encode()


class LeaderLink:
    """Rank 0's end. `command`/`replies` belong to one thread at a time (the caller serializes them),
    `fetch` to the server thread."""

    def __init__(self, host: str, world: int, heartbeat_s: float, token: str = "") -> None:
        """`token`: the cell's run token ("" reads $GYRE_TOKEN); a `host` beyond loopback needs one."""
        self.world = world
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._work = make_socket(self._ctx, zmq.ROUTER)
        self._fetch = make_socket(self._ctx, zmq.ROUTER)
        beat = make_socket(self._ctx, zmq.PUB)
        socks = (self._work, self._fetch, beat)
        try:
            bound = [bind(s, f"tcp://{host}:0", token, "ParallelConfig.token, --token-file") for s in socks]
        except BaseException:
            for s in socks:
                s.close(0)
            self._ctx.term()
            raise
        self.addresses = LinkAddresses(*bound)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = rank_reply_decoder()
        self._fetch_enc = msgspec.msgpack.Encoder()
        self._fetch_dec = rank_reply_decoder()
        self._stop = threading.Event()
        self._beat_thread = start_thread(lambda: self._beat(beat, heartbeat_s), "gyre-train-cell-beat")

    @property
    def followers(self) -> range:
        return range(1, self.world)

    def _beat(self, sock: zmq.Socket[bytes], every_s: float) -> None:
        try:
            while not self._stop.wait(every_s):
                sock.send(b"beat")
        finally:
            sock.close()

    def wait_followers(self, timeout_s: float) -> None:
        """Wait for every rank's hello on both channels (until then rank 0 could not address it)."""
        for sock, dec in ((self._work, self._dec), (self._fetch, self._fetch_dec)):
            seen: set[int] = set()
            deadline = time.monotonic() + timeout_s
            while len(seen) < self.world - 1:
                if not sock.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
                    raise RankSilentError(f"ranks {sorted(set(self.followers) - seen)} never connected")
                _, head = sock.recv_multipart()
                msg = dec.decode(head)
                if isinstance(msg, RankHello):
                    seen.add(msg.rank)

    def command(self, cmd: CellCommand, frames: Sequence[Any] = ()) -> None:
        """Send `cmd` (and raw frames) to every other rank; collect the answers with `replies`."""
        head = self._enc.encode(cmd)
        bufs = [f.buffer if isinstance(f, zmq.Frame) else f for f in frames]  # a received frame, as bytes
        for r in self.followers:
            self._work.send_multipart([_identity(r), head, *bufs], copy=False)

    def replies(self, timeout_s: float) -> list[RankReply]:
        """Every other rank's reply to the last command, by rank."""
        return self._gather(self._work, self._dec, set(self.followers), timeout_s)

    def send_fetch(self, commands: dict[int, CellCommand]) -> None:
        """Send each rank its own command on the fetch channel (collect with `fetch_replies`)."""
        for r, cmd in commands.items():
            self._fetch.send_multipart([_identity(r), self._fetch_enc.encode(cmd)])

    def fetch_replies(self, ranks: set[int], seq: int, timeout_s: float) -> list[RankReply]:
        """The replies of `ranks` to the fetch `seq` (a late reply to an earlier one is dropped)."""
        return self._gather(self._fetch, self._fetch_dec, ranks, timeout_s, seq)

    @staticmethod
    def _gather(
        sock: zmq.Socket[bytes],
        dec: msgspec.msgpack.Decoder[Any],
        want: set[int],
        timeout_s: float,
        seq: int | None = None,
    ) -> list[RankReply]:
        got: dict[int, RankReply] = {}
        deadline = time.monotonic() + timeout_s
        while want - set(got):
            if not sock.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
                raise RankSilentError(f"ranks {sorted(want - set(got))} did not answer within {timeout_s} s")
            _, head = sock.recv_multipart()
            msg = dec.decode(head)
            if isinstance(msg, RankReply) and msg.rank in want and (seq is None or msg.seq == seq):
                got[msg.rank] = msg
        return [got[r] for r in sorted(got)]

    def close(self) -> None:
        self._stop.set()
        self._beat_thread.join(timeout=5.0)
        self._work.close()
        self._fetch.close()
        self._ctx.term()


def everywhere[T](
    link: LeaderLink | None,
    cmd: CellCommand,
    local: Callable[[], T],
    timeout_s: float,
    frames: Sequence[Any] = (),
) -> tuple[T, list[RankReply]]:
    """`cmd` on every other rank and `local()` on rank 0, at once: rank 0's result and the other ranks'
    replies (RankFailedError if any failed; RankSilentError if any did not answer in `timeout_s`). With
    no link (a one-rank cell), `local()` alone."""
    if link is None or link.world == 1:
        return local(), []
    link.command(cmd, frames)
    try:
        mine = local()
    finally:
        replies = link.replies(timeout_s)
    bad = [r for r in replies if r.failure is not RankFailure.NONE]
    if bad:
        raise RankFailedError("; ".join(f"rank {r.rank}: {r.error}" for r in bad))
    return mine, replies


def merge_metrics(per_rank: Sequence[Sequence[dict[str, float]]], n: int) -> list[dict[str, float]]:
    """Per item of a round, the metrics of the first rank that computed its loss (with pipeline
    parallelism, the last stage), else rank 0's."""
    out: list[dict[str, float]] = [{} for _ in range(n)]
    for metrics in per_rank:
        for k, m in enumerate(metrics):
            if not out[k] or ("loss" in m and "loss" not in out[k]):
                out[k] = dict(m)
    return out


class FollowerLink:
    """A non-zero rank's end: the work socket belongs to the rank's main thread, the fetch socket to its
    fetch thread (after `take_fetch`)."""

    def __init__(self, addresses: LinkAddresses, rank: int, dead_after_s: float, token: str = "") -> None:
        """`token`: the cell's run token ("" reads $GYRE_TOKEN), as rank 0 has it."""
        self.rank = rank
        self._token = token
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._work = self._dealer(addresses.work)
        self._fetch: zmq.Socket[bytes] | None = self._dealer(addresses.fetch)
        self._dec = cell_command_decoder()
        self._enc = msgspec.msgpack.Encoder()
        self._stopping = threading.Event()
        sub = make_socket(self._ctx, zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        connect(sub, addresses.beat, token)
        self._watch = start_thread(lambda: self._watchdog(sub, dead_after_s), "gyre-train-cell-watchdog")

    def _dealer(self, address: str) -> zmq.Socket[bytes]:
        s = make_socket(self._ctx, zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, _identity(self.rank))
        connect(s, address, self._token)
        s.send(msgspec.msgpack.encode(RankHello(self.rank)))
        return s

    def _watchdog(self, sub: zmq.Socket[bytes], dead_after_s: float) -> None:
        last = time.monotonic()
        try:
            while not self._stopping.is_set():
                if sub.poll(200):
                    sub.recv()
                    last = time.monotonic()
                elif time.monotonic() - last > dead_after_s and not self._stopping.is_set():
                    sys.stderr.write(
                        f"gyre-train: rank {self.rank} heard nothing from rank 0 for {dead_after_s} s; "
                        f"the process exits ({THREAD_DIED})\n"
                    )
                    sys.stderr.flush()
                    os._exit(THREAD_DIED)
        finally:
            sub.close()

    def recv(self, timeout_s: float) -> tuple[CellCommand, list[Any]] | None:
        """The next command for this rank and its frames, or None after `timeout_s` without one."""
        if not self._work.poll(int(timeout_s * 1000)):
            return None
        head, *frames = self._work.recv_multipart(copy=False)
        return self._dec.decode(head.buffer), frames

    def reply(self, reply: RankReply) -> None:
        self._work.send(self._enc.encode(reply))

    def take_fetch(self) -> FetchEnd:
        """The fetch channel, for the one thread that serves it."""
        assert self._fetch is not None
        sock, self._fetch = self._fetch, None
        return FetchEnd(sock)

    def close(self) -> None:
        self._stopping.set()
        self._watch.join(timeout=2.0)
        self._work.close()
        if self._fetch is not None:
            self._fetch.close()
        self._ctx.term()


class FetchEnd:
    """A follower's fetch channel (owned by its fetch thread)."""

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self._sock = sock
        self._dec = cell_command_decoder()
        self._enc = msgspec.msgpack.Encoder()

    def recv(self, timeout_s: float) -> CellCommand | None:
        if not self._sock.poll(int(timeout_s * 1000)):
            return None
        return self._dec.decode(self._sock.recv())

    def reply(self, reply: RankReply) -> None:
        self._sock.send(self._enc.encode(reply))

    def close(self) -> None:
        self._sock.close()
