"""The ZeroMQ rule of `gyre_base.sockets` over real sockets: keys follow from the token and nothing else; a
bind beyond loopback without a token is refused naming the setting; with a token only peers holding it
reach the listener (every other one is refused by the ZAP handler, logged, and gets nothing), and what
crosses the wire is ciphertext; the ZAP handler lives and ends with its context."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Iterator

import pytest
import zmq
from gyre_base import sockets
from gyre_base.sockets import HWM, TokenConflictError, connected, derive_keys, make_socket
from gyre_base.testing import until
from gyre_base.token import TOKEN_ENV, TokenRequiredError, WeakTokenError

pytestmark = pytest.mark.usefixtures("no_token")

Ctx = zmq.Context[zmq.Socket[bytes]]
TOKEN = "base-test-token-0123456789abcdef"
WRONG = "base-test-token-fedcba9876543210"


class Echo:
    """A ROUTER bound with `sockets.bind` on its own context and thread, sending every message back."""

    def __init__(self, address: str, token: str) -> None:
        self.ctx: Ctx = zmq.Context()
        self.sock = make_socket(self.ctx, zmq.ROUTER)
        self.address = sockets.bind(self.sock, address, token, "Echo.token")
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while not self.stop.is_set():
            if self.sock.poll(20):
                self.sock.send_multipart(self.sock.recv_multipart())

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()


@contextlib.contextmanager
def echo(address: str, token: str) -> Iterator[Echo]:
    e = Echo(address, token)
    try:
        yield e
    finally:
        e.close()


def answered(sock: zmq.Socket[bytes], payload: bytes, timeout_s: float) -> bool:
    """Whether the echo answers `payload` within `timeout_s` (a refused handshake: never)."""
    try:
        sock.send(payload, zmq.NOBLOCK)
    except zmq.Again:  # a refused handshake leaves no connection to queue on
        return False
    return bool(sock.poll(int(timeout_s * 1000))) and sock.recv() == payload


# ---- keys --------------------------------------------------------------------------------------------------


def test_keys_follow_from_the_token_and_nothing_else() -> None:
    a, b, c = derive_keys(TOKEN), derive_keys(str(TOKEN)), derive_keys(WRONG)
    assert a == b and a != c
    assert len({a.server_public, a.client_public, c.server_public, c.client_public}) == 4
    assert zmq.curve_public(a.server_secret) == a.server_public
    assert zmq.curve_public(a.client_secret) == a.client_public
    assert TOKEN not in repr(a) and a.server_secret.decode() not in repr(a)
    with pytest.raises(WeakTokenError, match="at least 16"):
        derive_keys("hunter2")


def test_sockets_are_made_one_way() -> None:
    ctx: Ctx = zmq.Context()
    try:
        s = make_socket(ctx, zmq.DEALER)
        assert (s.getsockopt(zmq.LINGER), s.getsockopt(zmq.SNDHWM), s.getsockopt(zmq.RCVHWM)) == (0, HWM, HWM)
        s.close(0)
        s = make_socket(ctx, zmq.ROUTER, hwm=7)
        assert (s.getsockopt(zmq.SNDHWM), s.getsockopt(zmq.RCVHWM)) == (7, 7)
        s.close(0)
    finally:
        ctx.term()


# ---- the rule on real sockets ------------------------------------------------------------------------------


def test_bind_beyond_loopback_without_a_token_is_refused(beyond_loopback: str) -> None:
    ctx: Ctx = zmq.Context()
    sock = make_socket(ctx, zmq.ROUTER)
    try:
        for address in (f"tcp://{beyond_loopback}:0", "tcp://*:0", "tcp://0.0.0.0:0"):
            with pytest.raises(
                TokenRequiredError, match=rf"beyond loopback without a token: set {TOKEN_ENV} \(or X\.token\)"
            ):
                sockets.bind(sock, address, "", setting="X.token")
        assert sockets.bind(sock, "tcp://127.0.0.1:0").startswith("tcp://127.0.0.1:")  # loopback: plain
    finally:
        sock.close(0)
        ctx.term()


def test_with_a_token_only_holders_are_answered(
    beyond_loopback: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Clients without the token, with a wrong one, and a raw client that knows the server's public key
    but not the token's client key all get nothing, and each refusal is logged; holders are answered
    before, between and after them."""
    caplog.set_level(logging.WARNING)
    ctx: Ctx = zmq.Context()
    with echo(f"tcp://{beyond_loopback}:0", TOKEN) as e:
        try:
            assert e.address.startswith(f"tcp://{beyond_loopback}:")
            holder = connected(ctx, zmq.DEALER, e.address, TOKEN)
            assert answered(holder, b"first", 10.0)
            for token in ("", WRONG):
                intruder = connected(ctx, zmq.DEALER, e.address, token)
                assert not answered(intruder, b"intruder", 1.0), token
                intruder.close(0)
                assert answered(holder, b"between", 10.0)
            keyed = make_socket(ctx, zmq.DEALER)
            keyed.curve_serverkey = derive_keys(TOKEN).server_public
            keyed.curve_publickey, keyed.curve_secretkey = zmq.curve_keypair()
            keyed.connect(e.address)
            assert not answered(keyed, b"keyed", 1.0)
            keyed.close(0)
            assert answered(holder, b"last", 10.0)
            holder.close(0)
        finally:
            ctx.destroy(0)
    refused = [r.getMessage() for r in caplog.records if r.name == "gyre_base.sockets"]
    assert refused and all(m.startswith(f"refused a ZeroMQ peer from {beyond_loopback}") for m in refused)


def test_a_token_from_the_environment_applies_on_loopback_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """With $GYRE_TOKEN set, a loopback listener and its clients take it with no setting: one run, one
    rule; a client with another token is not answered."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    ctx: Ctx = zmq.Context()
    with echo("tcp://127.0.0.1:0", "") as e:
        try:
            holder, other = (
                connected(ctx, zmq.DEALER, e.address),
                connected(ctx, zmq.DEALER, e.address, WRONG),
            )
            assert answered(holder, b"env", 10.0) and not answered(other, b"wrong", 1.0)
            holder.close(0)
            other.close(0)
        finally:
            ctx.destroy(0)


def test_one_context_one_token_and_the_zap_handler_ends_with_it() -> None:
    def zap_threads() -> int:
        return sum(t.name == "gyre-zap" for t in threading.enumerate())

    before = zap_threads()
    ctx: Ctx = zmq.Context()
    a, b, c = (make_socket(ctx, zmq.ROUTER) for _ in range(3))
    sockets.bind(a, "tcp://127.0.0.1:0", TOKEN)
    sockets.bind(b, "tcp://127.0.0.1:0", TOKEN)  # same token: the same handler serves both
    assert zap_threads() == before + 1
    with pytest.raises(TokenConflictError):
        sockets.bind(c, "tcp://127.0.0.1:0", WRONG)
    for s in (a, b, c):
        s.close(0)
    ctx.term()  # returns: the handler closes its socket when the context ends
    until(lambda: zap_threads() == before, "the ZAP handler thread gone with its context", 10.0)


class Relay:
    """A plain TCP relay on loopback that keeps a copy of every byte it carries, both ways."""

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self.target = (host, int(port))
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.server.getsockname()[1]}"
        self.seen = bytearray()
        self.lock = threading.Lock()
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                a, _ = self.server.accept()
                b = socket.create_connection(self.target)
                for src, dst in ((a, b), (b, a)):
                    threading.Thread(target=self.pump, args=(src, dst), daemon=True).start()

    def pump(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError), src, dst:
            while data := src.recv(65536):
                with self.lock:
                    self.seen += data
                dst.sendall(data)


def test_frames_are_encrypted_on_the_wire() -> None:
    """What crosses the wire between a client and a listener holding a token is CURVE ciphertext: a
    marker sent through a relay in the middle is not in the bytes it saw (without a token, it is)."""
    marker = b"gyre-plaintext-marker-7f3a"
    for token, visible in (("", True), (TOKEN, False)):
        ctx: Ctx = zmq.Context()
        with echo("tcp://127.0.0.1:0", token) as e:
            relay = Relay(e.address)
            try:
                client = connected(ctx, zmq.DEALER, relay.address, token)
                assert answered(client, marker, 10.0)
                client.close(0)
                with relay.lock:
                    assert (marker in relay.seen) is visible, token
            finally:
                ctx.destroy(0)
                relay.server.close()


def test_connected_closes_its_socket_when_the_connect_fails() -> None:
    ctx: Ctx = zmq.Context()
    try:
        with pytest.raises(WeakTokenError):
            connected(ctx, zmq.DEALER, "tcp://127.0.0.1:1", "short")
        with pytest.raises(zmq.ZMQError):
            connected(ctx, zmq.DEALER, "no-such-transport://x")
    finally:
        term = threading.Thread(target=ctx.term)  # blocks while any socket of the context is open
        term.start()
        term.join(10.0)
    assert not term.is_alive(), "a socket of the failed connects was left open"
