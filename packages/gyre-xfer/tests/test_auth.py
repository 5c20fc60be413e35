"""gyre-xfer's publisher under the run token's rule (`gyre_base.sockets`), over real ZeroMQ sockets: it
binds loopback by default and refuses a bind beyond loopback without a token, naming its setting; with a
token it serves subscribers holding it and nobody else, and keeps serving them; `$GYRE_TOKEN` alone
secures both sides. The rule itself (keys, ZAP handler, ciphertext on the wire) is tested in gyre-base.
Mooncake's ports, which no token guards, listen on every interface: checked so a change is noticed."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq
from gyre_base.sockets import connected, derive_keys, make_socket
from gyre_base.token import TOKEN_ENV, TokenRequiredError, is_loopback_endpoint
from gyre_xfer.errors import PeerTimeoutError
from gyre_xfer.protocol import PROTOCOL_VERSION, Hello, Welcome, reply_decoder
from gyre_xfer.publisher import Publisher, PublisherConfig
from gyre_xfer.subscriber import Subscriber, SubscriberConfig
from gyre_xfer.transport import Config, open_transport

pytestmark = pytest.mark.usefixtures("no_token")

Ctx = zmq.Context[zmq.Socket[bytes]]
TOKEN = "xfer-test-token-0123456789abcdef"
WRONG = "xfer-test-token-fedcba9876543210"


# ---- the rule on real sockets ------------------------------------------------------------------------------


def test_bind_beyond_loopback_without_a_token_is_refused(beyond_loopback: str) -> None:
    tr = open_transport(Config(kind="shm"))
    try:
        with pytest.raises(
            TokenRequiredError,
            match=rf"beyond loopback without a token: set {TOKEN_ENV} \(or PublisherConfig\.token\)",
        ):
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
        keyed = make_socket(ctx, zmq.DEALER)
        keyed.curve_serverkey = derive_keys(TOKEN).server_public
        keyed.curve_publickey, keyed.curve_secretkey = zmq.curve_keypair()
        keyed.connect(pub.address)
        assert _hello(keyed, 1.0) is None
        good_pull()
        holder = connected(ctx, zmq.DEALER, pub.address, TOKEN)
        assert isinstance(_hello(holder, 5.0), Welcome)
        good.close()
    finally:
        ctx.destroy(0)
        pub.close()
        pub_tr.close()
        sub_tr.close()
    refused = [r.getMessage() for r in caplog.records if r.name == "gyre_base.sockets"]
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


def test_default_listeners_bind_loopback() -> None:
    assert is_loopback_endpoint(PublisherConfig().control)
    tr = open_transport(Config(kind="shm"))
    pub = Publisher(tr)
    try:
        assert pub.address.startswith("tcp://127.0.0.1:")
    finally:
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
