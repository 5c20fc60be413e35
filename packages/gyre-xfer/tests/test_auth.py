"""The authentication rule of `gyre_xfer.auth` over real ZeroMQ sockets: keys follow from the token and
nothing else; a bind beyond loopback without a token is refused naming the setting; a publisher with a
token serves subscribers holding it and nobody else, and keeps serving them; loopback without a token
works as before; the ZAP handler lives and ends with its context."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq
from gyre_xfer import auth
from gyre_xfer.auth import (
    TOKEN_ENV,
    AuthError,
    TokenConflictError,
    TokenRequiredError,
    WeakTokenError,
    derive_keys,
)
from gyre_xfer.errors import PeerTimeoutError
from gyre_xfer.protocol import PROTOCOL_VERSION, Hello, Welcome, reply_decoder
from gyre_xfer.publisher import Publisher, PublisherConfig
from gyre_xfer.subscriber import Subscriber, SubscriberConfig
from gyre_xfer.transport import Config, open_transport

Ctx = zmq.Context[zmq.Socket[bytes]]
TOKEN = "xfer-test-token-0123456789abcdef"
WRONG = "xfer-test-token-fedcba9876543210"


@pytest.fixture(autouse=True)
def _no_token_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)


# ---- keys and tokens ---------------------------------------------------------------------------------------


def test_keys_follow_from_the_token_and_nothing_else() -> None:
    a, b, c = derive_keys(TOKEN), derive_keys(str(TOKEN)), derive_keys(WRONG)
    assert a == b and a != c
    assert len({a.server_public, a.client_public, c.server_public, c.client_public}) == 4
    assert zmq.curve_public(a.server_secret) == a.server_public
    assert zmq.curve_public(a.client_secret) == a.client_public
    assert TOKEN not in repr(a) and a.server_secret.decode() not in repr(a)


def test_tokens_come_from_the_setting_then_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert auth.resolve_token("") == ""
    monkeypatch.setenv(TOKEN_ENV, f" {TOKEN}\n")
    assert auth.resolve_token("") == TOKEN
    assert auth.resolve_token(WRONG) == WRONG
    f = tmp_path / "token"
    f.write_text(f"{TOKEN}\n# anything after the first line is ignored\n")
    assert auth.read_token_file(str(f)) == TOKEN
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(AuthError, match="holds no token"):
        auth.read_token_file(str(tmp_path / "empty"))
    with pytest.raises(AuthError, match="cannot read the token file"):
        auth.read_token_file(str(tmp_path / "missing"))
    with pytest.raises(WeakTokenError, match="at least 16"):
        derive_keys("hunter2")
    assert len(auth.new_token()) == 43 and auth.new_token() != auth.new_token()


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("tcp://127.0.0.1:5555", True),
        ("tcp://127.1.2.3:0", True),
        ("tcp://[::1]:5555", True),
        ("tcp://localhost:5555", True),
        ("ipc:///tmp/gyre.sock", True),
        ("inproc://x", True),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://*:5555", False),
        ("tcp://eth0:5555", False),
        ("tcp://192.0.2.7:5555", False),
        ("tcp://[::]:5555", False),
        ("tcp://127.0.0.1.example.com:5555", False),
    ],
)
def test_what_counts_as_loopback(address: str, loopback: bool) -> None:
    assert auth.is_loopback(address) is loopback


# ---- the rule on real sockets ------------------------------------------------------------------------------


def test_bind_beyond_loopback_without_a_token_is_refused(beyond_loopback: str) -> None:
    ctx: Ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    for address in (f"tcp://{beyond_loopback}:0", "tcp://*:0"):
        with pytest.raises(TokenRequiredError, match=rf"beyond loopback without a token: set {TOKEN_ENV}"):
            auth.bind(sock, address, "", setting="X.token")
    assert auth.bind(sock, "tcp://127.0.0.1:0").startswith("tcp://127.0.0.1:")  # loopback: as before
    sock.close(0)
    ctx.term()
    tr = open_transport(Config(kind="shm"))
    try:
        with pytest.raises(TokenRequiredError, match=r"`PublisherConfig\.token` setting"):
            Publisher(tr, PublisherConfig(control=f"tcp://{beyond_loopback}:0"))
    finally:
        tr.close()


def _hello(sock: zmq.Socket[bytes], timeout_s: float) -> object | None:
    try:
        sock.send_multipart([b"1", msgspec.msgpack.encode(Hello(PROTOCOL_VERSION, "x"))], zmq.NOBLOCK)
    except zmq.Again:
        return None
    if not sock.poll(int(timeout_s * 1000)):
        return None
    return reply_decoder().decode(sock.recv_multipart()[-1])


def test_publisher_serves_token_holders_only(beyond_loopback: str, caplog: pytest.LogCaptureFixture) -> None:
    """Subscribers without the token, with a wrong one, and a raw client that knows the server's public
    key but not the token's client key all get nothing (the publisher would answer even garbage with an
    error reply, so silence means no frame reached its decoder); holders pull whole versions throughout."""
    caplog.set_level(logging.WARNING)
    pub_tr, sub_tr = open_transport(Config(kind="shm")), open_transport(Config(kind="shm"))
    pub = Publisher(pub_tr, PublisherConfig(control=f"tcp://{beyond_loopback}:0", token=TOKEN))
    ctx: Ctx = zmq.Context()
    try:
        assert pub.address.startswith(f"tcp://{beyond_loopback}:")
        v = pub.publish({"w": np.arange(1000, dtype=np.float32)})
        good = Subscriber(sub_tr, SubscriberConfig(pub.address, token=TOKEN))

        def good_pull() -> None:
            snap = good.pull(min_version=v)
            assert snap.arrays["w"].tolist() == list(range(1000))

        good_pull()
        for token in ("", WRONG):
            with (
                Subscriber(sub_tr, SubscriberConfig(pub.address, control_timeout_s=1.0, token=token)) as bad,
                pytest.raises(PeerTimeoutError, match=TOKEN_ENV),
            ):
                bad.pull()
            good_pull()
        keyed = ctx.socket(zmq.DEALER)
        keyed.setsockopt(zmq.LINGER, 0)
        keyed.curve_serverkey = derive_keys(TOKEN).server_public
        keyed.curve_publickey, keyed.curve_secretkey = zmq.curve_keypair()
        keyed.connect(pub.address)
        assert _hello(keyed, 1.0) is None
        good_pull()
        holder = ctx.socket(zmq.DEALER)
        holder.setsockopt(zmq.LINGER, 0)
        auth.connect(holder, pub.address, TOKEN)
        assert isinstance(_hello(holder, 5.0), Welcome)
        good.close()
    finally:
        ctx.destroy(0)
        pub.close()
        pub_tr.close()
        sub_tr.close()
    refused = [r.getMessage() for r in caplog.records if r.name == "gyre_xfer.auth"]
    assert refused and all(m.startswith(f"refused a ZeroMQ peer from {beyond_loopback}") for m in refused)


def test_token_from_the_environment_on_both_sides(monkeypatch: pytest.MonkeyPatch) -> None:
    """GYRE_TOKEN alone secures the default (loopback) publisher and its subscribers: the processes of
    one run share it through their environment, with no code change."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    pub_tr, sub_tr = open_transport(Config(kind="shm")), open_transport(Config(kind="shm"))
    pub = Publisher(pub_tr)
    try:
        v = pub.publish({"w": np.ones(8, np.int64)})
        with Subscriber(sub_tr, SubscriberConfig(pub.address)) as sub:
            assert sub.pull(min_version=v).arrays["w"].sum() == 8
        with (
            Subscriber(sub_tr, SubscriberConfig(pub.address, control_timeout_s=1.0, token=WRONG)) as sub,
            pytest.raises(PeerTimeoutError),
        ):
            sub.pull()
    finally:
        pub.close()
        pub_tr.close()
        sub_tr.close()


def test_one_context_one_token_and_the_zap_handler_ends_with_it() -> None:
    def zap_threads() -> int:
        return sum(t.name == "gyre-zap" for t in threading.enumerate())

    before = zap_threads()
    ctx: Ctx = zmq.Context()
    a, b, c = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    auth.bind(a, "tcp://127.0.0.1:0", TOKEN)
    auth.bind(b, "tcp://127.0.0.1:0", TOKEN)  # same token: the same handler serves both
    assert zap_threads() == before + 1
    with pytest.raises(TokenConflictError):
        auth.bind(c, "tcp://127.0.0.1:0", WRONG)
    for s in (a, b, c):
        s.close(0)
    ctx.term()  # returns: the handler closes its socket when the context ends
    for _ in range(100):
        if zap_threads() == before:
            break
        threading.Event().wait(0.02)
    assert zap_threads() == before


def test_default_listeners_bind_loopback() -> None:
    assert auth.is_loopback(PublisherConfig().control)
    tr = open_transport(Config(kind="shm"))
    pub = Publisher(tr)
    try:
        assert pub.address.startswith("tcp://127.0.0.1:")
    finally:
        pub.close()
        tr.close()


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
    """What crosses the wire between a subscriber and a publisher holding a token is CURVE ciphertext: a
    marker sent in a Hello is not in the bytes a relay in the middle saw (without a token, it is)."""
    marker = "gyre-plaintext-marker-7f3a"
    for token, visible in (("", True), (TOKEN, False)):
        tr = open_transport(Config(kind="shm"))
        pub = Publisher(tr, PublisherConfig(token=token))
        relay = Relay(pub.address)
        ctx: Ctx = zmq.Context()
        try:
            client = ctx.socket(zmq.DEALER)
            client.setsockopt(zmq.LINGER, 0)
            auth.connect(client, relay.address, token)
            client.send_multipart([b"1", msgspec.msgpack.encode(Hello(PROTOCOL_VERSION, marker))])
            assert client.poll(10_000)
            assert isinstance(reply_decoder().decode(client.recv_multipart()[1]), Welcome)
            with relay.lock:
                assert (marker.encode() in relay.seen) is visible, token
        finally:
            ctx.destroy(0)
            relay.server.close()
            pub.close()
            tr.close()


def _listening_here() -> set[tuple[str, int]]:
    """(hex address, port) of every TCP socket this process listens on (from /proc)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # state LISTEN, our socket
                addr, port = f[1].rsplit(":", 1)
                out.add((addr, int(port, 16)))
    return out


@pytest.mark.mooncake
def test_mooncake_ports_listen_on_every_interface() -> None:
    """The fact SECURITY.md warns about, checked so a change in Mooncake is noticed: asked for
    127.0.0.1, Mooncake's handshake and data ports listen on 0.0.0.0 / [::], and take no token."""
    before = _listening_here()
    tr = open_transport(Config(kind="mooncake", hostname="127.0.0.1"))
    try:
        new = _listening_here() - before
        rpc_port = int(tr.endpoint.rsplit(":", 1)[1])
        assert rpc_port in {port for _, port in new}
        assert new and all(set(addr) == {"0"} for addr, _ in new), new  # every one on all interfaces
    finally:
        tr.close()
