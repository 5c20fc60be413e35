"""Weight snapshots between two real processes: byte-exact pulls over Mooncake TCP and shared memory,
one whole version or an error while the publisher keeps writing, clear errors for bad input, and a
subscriber that carries on after the publisher restarts."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator

import msgspec
import numpy as np
import pytest
import zmq
from gyre_base.testing import free_port
from gyre_xfer.errors import (
    ChecksumError,
    ManifestError,
    PeerGoneError,
    ShapeMismatchError,
    SnapshotOverwrittenError,
    XferError,
)
from gyre_xfer.protocol import (
    ErrorReply,
    Lease,
    Manifest,
    RegionDesc,
    Release,
    Released,
    TensorEntry,
    TransportKind,
    reply_decoder,
    request_decoder,
)
from gyre_xfer.publisher import Publisher
from gyre_xfer.subscriber import Snapshot, Subscriber, SubscriberConfig
from gyre_xfer.transport import Config, Transport, open_transport

from .conftest import Peer
from .peer_proc import fill_value

KINDS = [pytest.param("mooncake", marks=pytest.mark.mooncake), "shm"]


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def transport(kind: str) -> Iterator[Transport]:
    tr = open_transport(Config(kind=kind, progress_timeout_s=2))
    yield tr
    tr.close()


def check_whole(snap: Snapshot, n: int = 4) -> None:
    """Every tensor holds the bytes of `snap.version`, none of another version."""
    for i in range(n):
        arr = snap.arrays[f"t{i}"]
        want = fill_value(snap.version, i)
        assert arr.min() == want == arr.max(), f"t{i} of version {snap.version} is torn"
    assert (snap.arrays["bf16"] == snap.version).all()


def test_two_processes_byte_exact(spawn: Callable[..., Peer], transport: Transport, kind: str) -> None:
    peer = spawn("publisher", kind, tensor_bytes=3 << 20)
    control = json.loads(peer.info)["control"]
    with Subscriber(transport, SubscriberConfig(control, bucket_bytes=1 << 20)) as sub:
        assert sub.hello().transport is TransportKind[kind.upper()]
        snap = sub.pull()
        assert snap.version == 1
        check_whole(snap)
        assert snap.arrays["bf16"].shape == (3, 5)
        assert snap.manifest.tensors[-1].dtype == "bfloat16"
        peer.send("publish")
        assert json.loads(peer.readline())["version"] == 2
        dest = {f"t{i}": np.zeros(3 << 20, np.uint8) for i in range(4)}
        dest["bf16"] = np.zeros((3, 5), np.uint16)
        snap2 = sub.pull(min_version=2, into=dest, dtypes={"bf16": "bfloat16"})
        assert snap2.version == 2
        for i in range(4):
            assert (dest[f"t{i}"] == fill_value(2, i)).all()
        assert (dest["bf16"] == 2).all()


def test_torch_views_keep_bfloat16(spawn: Callable[..., Peer], transport: Transport) -> None:
    torch = pytest.importorskip("torch")
    peer = spawn("publisher", transport.kind.name.lower())
    with Subscriber(transport, SubscriberConfig(json.loads(peer.info)["control"])) as sub:
        t = sub.pull().torch()
        assert t["bf16"].dtype == torch.bfloat16 and tuple(t["bf16"].shape) == (3, 5)
        assert (t["bf16"].view(torch.uint16) == 1).all()
        into = {f"t{i}": torch.zeros(1 << 20, dtype=torch.uint8) for i in range(4)}
        into["bf16"] = torch.zeros(3, 5, dtype=torch.bfloat16)
        sub.pull(into=into)
        assert (into["bf16"].view(torch.uint16) == 1).all()
        assert int(into["t3"][0]) == fill_value(1, 3)


@pytest.mark.slow
def test_pull_while_publisher_writes_is_one_version(spawn: Callable[..., Peer], transport: Transport) -> None:
    peer = spawn("publisher", transport.kind.name.lower(), tensor_bytes=4 << 20)
    with Subscriber(
        transport, SubscriberConfig(json.loads(peer.info)["control"], bucket_bytes=1 << 20)
    ) as sub:
        peer.send("churn")
        versions = []
        for _ in range(12):
            snap = sub.pull()
            check_whole(snap)
            versions.append(snap.version)
        assert versions == sorted(versions) and versions[-1] > versions[0]


@pytest.mark.slow
def test_expired_lease_gives_an_error_never_a_torn_version(
    spawn: Callable[..., Peer], transport: Transport
) -> None:
    # leases that expire at once let the publisher rewrite the slot under the pull
    peer = spawn(
        "publisher", transport.kind.name.lower(), tensor_bytes=4 << 20, lease_s=0.0, publish_wait_s=1.0
    )
    cfg = SubscriberConfig(json.loads(peer.info)["control"], bucket_bytes=256 << 10)
    outcomes = {"whole": 0, "error": 0}
    with Subscriber(transport, cfg) as sub:
        peer.send("churn")
        for _ in range(15):
            try:
                check_whole(sub.pull())
                outcomes["whole"] += 1
            except (SnapshotOverwrittenError, ChecksumError):
                outcomes["error"] += 1
    assert outcomes["whole"] + outcomes["error"] == 15  # every pull was whole or an error, none torn


class _RewritingTransport:
    """Wraps a real transport so the in-process publisher writes the next version in the middle of a pull."""

    def __init__(self, inner: Transport, during: Callable[[], None]) -> None:
        self.inner, self.during, self.calls = inner, during, 0
        self.kind = inner.kind

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def read(self, peer: str, ops: object, timeout_s: float | None = None) -> object:
        self.calls += 1
        if self.calls == 2:
            self.during()
        return self.inner.read(peer, ops, timeout_s)  # type: ignore[arg-type]


def test_rewrite_during_pull_is_detected(kind: str) -> None:
    from gyre_xfer.publisher import Publisher, PublisherConfig

    pub_tr = open_transport(Config(kind=kind))
    sub_tr = open_transport(Config(kind=kind))
    pub = Publisher(pub_tr, PublisherConfig(lease_s=0.0, publish_wait_s=1.0))

    def publish() -> None:
        v = pub.version + 1
        pub.publish(
            {f"t{i}": np.full(1 << 20, fill_value(v, i), np.uint8) for i in range(4)}
            | {"bf16": np.full((3, 5), v, np.uint16)}
        )

    publish()
    rewriting = _RewritingTransport(sub_tr, lambda: (publish(), publish()))
    try:
        with Subscriber(rewriting, SubscriberConfig(pub.address, bucket_bytes=1 << 20)) as sub:  # type: ignore[arg-type]
            with pytest.raises(SnapshotOverwrittenError, match="version 1 changed under the pull"):
                sub.pull()
            check_whole(sub.pull())  # the next pull gets a whole, newer version
    finally:
        pub.close()
        pub_tr.close()
        sub_tr.close()


def test_wrong_shapes_are_rejected_and_lose_nothing(spawn: Callable[..., Peer], transport: Transport) -> None:
    peer = spawn("publisher", transport.kind.name.lower())
    with Subscriber(transport, SubscriberConfig(json.loads(peer.info)["control"])) as sub:
        dest = {f"t{i}": np.zeros(1 << 20, np.uint8) for i in range(4)}
        dest["bf16"] = np.zeros((5, 3), np.uint16)
        with pytest.raises(
            ShapeMismatchError,
            match=r"'bf16': manifest has bfloat16\[3, 5\], destination is bfloat16\[5, 3\]",
        ):
            sub.pull(into=dest, dtypes={"bf16": "bfloat16"})
        with pytest.raises(ShapeMismatchError, match=r"missing \['bf16'\]"):
            sub.pull(into={f"t{i}": dest[f"t{i}"] for i in range(4)})
        dest["bf16"] = np.zeros((3, 5), np.float16)
        with pytest.raises(ShapeMismatchError, match="float16"):
            sub.pull(into=dest)
        assert (dest["t0"] == 0).all()  # nothing was written
        check_whole(sub.pull())  # and the lease was given back: the next pull works


@pytest.mark.slow
def test_publisher_restart_is_picked_up(spawn: Callable[..., Peer], transport: Transport) -> None:
    kind = transport.kind.name.lower()
    control = f"tcp://127.0.0.1:{free_port()}"
    first = spawn("publisher", kind, control=control)
    with Subscriber(transport, SubscriberConfig(control, control_timeout_s=2.0)) as sub:
        check_whole(sub.pull())
        first.proc.kill()
        first.proc.wait(timeout=10)
        with pytest.raises(PeerGoneError, match="connection refused"):
            sub.pull()
        second = spawn("publisher", kind, control=control)
        second.send("publish")
        second.readline()
        snap = sub.pull(min_version=2)
        check_whole(snap)
        assert sub.stats.restarts_seen == 1


class FakePublisher:
    """A real ZeroMQ ROUTER on loopback answering every Acquire with a chosen manifest."""

    def __init__(self, manifest: Manifest) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.manifest = manifest
        self.released: list[int] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        dec = request_decoder()
        enc = msgspec.msgpack.Encoder()
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, rid, payload = self.sock.recv_multipart()
            req = dec.decode(payload)
            if isinstance(req, Release):
                self.released.append(req.lease_id)
                reply: Lease | Released | ErrorReply = Released(req.lease_id, True)
            else:
                reply = Lease(7, 10.0, self.manifest)
            self.sock.send_multipart([ident, rid, enc.encode(reply)])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.sock.close()
        self.ctx.term()


@pytest.mark.parametrize(
    ("tensors", "words"),
    [
        ((TensorEntry("w", "float32", (4, 4), 0, 60, 0),), "needs 64"),
        ((TensorEntry("w", "float32", (4, 4), 4090, 64, 0),), "outside"),
        ((TensorEntry("w", "complex", (4,), 0, 16, 0),), "unknown dtype"),
    ],
)
def test_bad_manifest_from_a_live_socket_is_rejected(
    transport: Transport, tensors: tuple[TensorEntry, ...], words: str
) -> None:
    m = Manifest(1, "x", transport.kind, transport.endpoint, RegionDesc(1, 4096, 1 << 30), tensors)
    fake = FakePublisher(m)
    try:
        with (
            Subscriber(
                transport, SubscriberConfig(f"tcp://127.0.0.1:{fake.port}", control_timeout_s=5)
            ) as sub,
            pytest.raises(ManifestError, match=words),
        ):
            sub.pull()
        assert fake.released == [7]  # the lease was handed back
    finally:
        fake.close()


@pytest.mark.mooncake  # both cases: the publisher is of the other kind
def test_no_version_yet_and_wrong_transport_are_errors(
    spawn: Callable[..., Peer], transport: Transport
) -> None:
    other = "shm" if transport.kind is TransportKind.MOONCAKE else "mooncake"
    peer = spawn("publisher", other)
    with Subscriber(transport, SubscriberConfig(json.loads(peer.info)["control"])) as sub:
        with pytest.raises(XferError, match="transport"):
            sub.hello()
        with pytest.raises(XferError, match="no version >= 99"):
            sub.pull(min_version=99)


def test_empty_and_non_contiguous_tensors(kind: str) -> None:
    pub_tr, sub_tr = open_transport(Config(kind=kind)), open_transport(Config(kind=kind))
    pub = Publisher(pub_tr)
    try:
        with pytest.raises(ShapeMismatchError, match="C-contiguous"):
            pub.publish({"t": np.zeros((4, 4), np.float32).T})
        with pytest.raises(ShapeMismatchError, match="expected a numpy array or torch tensor"):
            pub.publish({"t": [1, 2, 3]})
        v = pub.publish({"empty": np.zeros((0, 7), np.float16), "one": np.array(3.5), "x": np.arange(5)})
        with Subscriber(sub_tr, SubscriberConfig(pub.address)) as sub:
            snap = sub.pull(min_version=v)
            assert snap.arrays["empty"].shape == (0, 7) and snap.arrays["empty"].dtype == np.float16
            assert snap.arrays["one"].shape == () and float(snap.arrays["one"]) == 3.5
            assert snap.arrays["x"].tolist() == [0, 1, 2, 3, 4]
    finally:
        pub.close()
        pub_tr.close()
        sub_tr.close()


def test_only_the_holder_releases_a_lease() -> None:
    """Lease ids are small consecutive numbers: another connection releasing them used to end the
    holder's protection (its pull then failed as overwritten). Now only the acquiring connection can."""
    from gyre_xfer.protocol import Acquire

    pub_tr = open_transport(Config(kind="shm"))
    pub = Publisher(pub_tr)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    enc, dec = msgspec.msgpack.Encoder(), reply_decoder()

    def ask(sock: zmq.Socket[bytes], req: Acquire | Release) -> object:
        sock.send_multipart([b"1", enc.encode(req)])
        assert sock.poll(5000)
        return dec.decode(sock.recv_multipart()[1])

    try:
        pub.publish({"w": np.zeros(4, np.uint8)})
        holder, other = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        for s in (holder, other):
            s.setsockopt(zmq.LINGER, 0)
            s.connect(pub.address)
        lease = ask(holder, Acquire())
        assert isinstance(lease, Lease)
        refused = ask(other, Release(lease.lease_id))
        assert isinstance(refused, ErrorReply) and "not held by this peer" in refused.message
        assert ask(holder, Release(lease.lease_id)) == Released(lease.lease_id, True)
    finally:
        ctx.destroy(0)
        pub.close()
        pub_tr.close()


def test_a_manifest_reaching_past_max_bytes_is_refused_before_any_allocation() -> None:
    """A publisher's manifest decides how much staging a pull maps: a tensor declared 2 MiB into the
    slot, against `max_bytes` of 1 MiB, is a ManifestError before anything is allocated; staging is sized
    by where the tensors end, not by the region's declared size (1 GiB here, for a 64-byte tensor)."""
    tr, peer = open_transport(Config(kind="shm")), open_transport(Config(kind="shm"))
    live = peer.alloc(4096).desc
    region = RegionDesc(live.region_id, 1 << 30, live.addr, live.shm_name)
    far = (TensorEntry("w", "uint8", (64,), 2 << 20, 64, -1),)
    near = (TensorEntry("w", "uint8", (64,), 0, 64, -1),)
    try:
        for tensors, err, words in (
            (far, ManifestError, "over this subscriber's max_bytes"),
            (near, XferError, "descriptor says 1073741824"),  # got as far as reading: no staging of 1 GiB
        ):
            fake = FakePublisher(Manifest(1, "x", TransportKind.SHM, tr.endpoint, region, tensors))
            cfg = SubscriberConfig(f"tcp://127.0.0.1:{fake.port}", control_timeout_s=5.0, max_bytes=1 << 20)
            try:
                with Subscriber(tr, cfg) as sub, pytest.raises(err, match=words):
                    sub.pull()
            finally:
                fake.close()
    finally:
        tr.close()
        peer.close()


def test_a_publisher_whose_serving_thread_dies_says_so_on_publish(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The serving thread dying (here: its decoder raises something unexpected) is logged with its
    traceback and every later publish raises PublisherDeadError, instead of a publisher nobody hears."""
    import time

    import gyre_xfer.publisher as publisher_module
    import zmq
    from gyre_xfer.errors import PublisherDeadError

    class Exploding:
        def decode(self, payload: bytes) -> object:
            raise RuntimeError("decoder bug")

    monkeypatch.setattr(publisher_module, "request_decoder", Exploding)
    tr = open_transport(Config(kind="shm"))
    pub = Publisher(tr)
    try:
        pub.publish({"w": np.arange(4, dtype=np.float32)})
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.connect(pub.address)
        s.send_multipart([b"1", b"anything"])
        deadline = time.monotonic() + 10
        while pub.failure is None and time.monotonic() < deadline:
            time.sleep(0.01)
        s.close(0)
        ctx.term()
        assert isinstance(pub.failure, RuntimeError)
        with pytest.raises(PublisherDeadError, match="decoder bug"):
            pub.publish({"w": np.arange(4, dtype=np.float32)})
        assert "stopped serving" in caplog.text
    finally:
        pub.close()
        tr.close()


@pytest.mark.parametrize("copy_threads", [1, 4])
def test_a_large_shm_pull_copies_on_threads_and_verifies_in_pieces(
    spawn: Callable[..., Peer], copy_threads: int
) -> None:
    """96 MiB in one bucket from another process: over the 64 MiB from which the shared-memory transport
    copies a batch on several threads (unless copy_threads=1), each tensor over the 16 MiB hashing piece;
    whole versions, byte-exact, into staging and into the caller's buffers."""
    peer = spawn("publisher", "shm", tensor_bytes=24 << 20)
    tr = open_transport(Config(kind="shm", copy_threads=copy_threads))
    try:
        with Subscriber(tr, SubscriberConfig(json.loads(peer.info)["control"])) as sub:
            check_whole(sub.pull())
            peer.send("publish")
            assert json.loads(peer.readline())["version"] == 2
            dest = {f"t{i}": np.zeros(24 << 20, np.uint8) for i in range(4)}
            dest["bf16"] = np.zeros((3, 5), np.uint16)
            assert sub.pull(min_version=2, into=dest, dtypes={"bf16": "bfloat16"}).version == 2
            for i in range(4):
                assert (dest[f"t{i}"] == fill_value(2, i)).all()
    finally:
        tr.close()
