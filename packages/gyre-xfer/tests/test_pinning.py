"""Page-locking hooks on a real publisher and subscriber over shared memory: each staging buffer and
each slot is pinned once when allocated and unpinned while still mapped, before it is replaced by a
larger one and on close; pulls into caller buffers never pin; a refused pin is a logged warning and the
bytes still arrive exact. The recording `Pinning` stands in for CUDA (`CudaHostPinning` runs in
gyre-engine's CUDA test); it sees exactly the regions the real one would be given."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from gyre_xfer.pinning import PinningError, host_pinning
from gyre_xfer.publisher import Publisher, PublisherConfig
from gyre_xfer.shm import SHM_DIR
from gyre_xfer.subscriber import Subscriber, SubscriberConfig
from gyre_xfer.transport import Config, Region, open_transport


class Recorder:
    """A Pinning that records each call, and whether the region's segment still existed at unpin."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.events: list[tuple[str, int, int]] = []  # (what, region id, nbytes)
        self.pinned: set[int] = set()

    def pin(self, region: Region) -> None:
        self.events.append(("pin", region.desc.region_id, region.nbytes))
        if self.refuse:
            raise PinningError("driver said no")
        assert region.array is not None and region.device == "cpu"
        self.pinned.add(region.desc.region_id)

    def unpin(self, region: Region) -> None:
        assert region.desc.region_id in self.pinned, "unpinned a region this pinning did not pin"
        assert os.path.exists(os.path.join(SHM_DIR, region.desc.shm_name)), "unpinned after release"
        self.pinned.discard(region.desc.region_id)
        self.events.append(("unpin", region.desc.region_id, region.nbytes))


class RecordingTransport:
    """The shared-memory transport, with its unregister calls added to a Recorder's log."""

    def __init__(self, rec: Recorder) -> None:
        self.inner = open_transport(Config(kind="shm"))
        self.rec = rec

    def unregister(self, region: Region) -> None:
        self.rec.events.append(("unregister", region.desc.region_id, region.nbytes))
        self.inner.unregister(region)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def weights(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.integers(0, 1 << 16, size=(n, 64), dtype=np.uint16),
        "b": rng.standard_normal(n).astype(np.float32),
    }


def check_exact(snap_arrays: Any, sent: dict[str, np.ndarray]) -> None:
    for name, arr in sent.items():
        assert np.array_equal(snap_arrays[name], arr), name


@pytest.fixture
def publisher() -> Iterator[Publisher]:
    tr = open_transport(Config(kind="shm"))
    pub = Publisher(tr)
    yield pub
    pub.close()
    tr.close()


def test_staging_pinned_once_per_buffer_and_again_only_when_it_grows(publisher: Publisher) -> None:
    rec = Recorder()
    tr = RecordingTransport(rec)
    sub = Subscriber(tr, SubscriberConfig(publisher.address, pinning=rec))  # type: ignore[arg-type]
    try:
        small = weights(32, 0)
        publisher.publish(small, {"w": "bfloat16"})
        for _ in range(3):
            snap = sub.pull()
            assert snap.pinned and sub.staging_pinned
            check_exact(snap.arrays, small)
        pins = [e for e in rec.events if e[0] == "pin"]
        assert len(pins) == 1 and rec.events == pins  # three pulls, one buffer, one pin
        first = pins[0][1]

        same = weights(32, 1)  # same size: the staging is reused, not pinned again
        publisher.publish(same, {"w": "bfloat16"})
        check_exact(sub.pull().arrays, same)
        assert len(rec.events) == 1

        big = weights(4096, 2)  # grows: old one unpinned (still mapped), then released, then new pinned
        publisher.publish(big, {"w": "bfloat16"})
        snap = sub.pull()
        check_exact(snap.arrays, big)
        assert snap.pinned
        assert [e[0] for e in rec.events] == ["pin", "unpin", "unregister", "pin"]
        assert rec.events[1][1] == rec.events[2][1] == first
        second = rec.events[3][1]
        assert second != first and rec.events[3][2] > rec.events[0][2]
    finally:
        sub.close()
    assert rec.events[4:] == [("unpin", second, rec.events[3][2]), ("unregister", second, rec.events[3][2])]
    assert not rec.pinned
    tr.inner.close()


def test_pulls_into_caller_buffers_never_pin(publisher: Publisher) -> None:
    rec = Recorder()
    tr = open_transport(Config(kind="shm"))
    sent = weights(64, 3)
    publisher.publish(sent, {"w": "bfloat16"})
    into = {k: np.zeros_like(v) for k, v in sent.items()}
    with Subscriber(tr, SubscriberConfig(publisher.address, pinning=rec)) as sub:
        snap = sub.pull(into=into, dtypes={"w": "bfloat16"})
        assert not snap.pinned and not sub.staging_pinned
    check_exact(into, sent)
    assert rec.events == []
    tr.close()


def test_refused_pin_is_a_warning_and_the_pull_stays_exact(
    publisher: Publisher, caplog: pytest.LogCaptureFixture
) -> None:
    rec = Recorder(refuse=True)
    tr = open_transport(Config(kind="shm"))
    sent = weights(256, 4)
    publisher.publish(sent, {"w": "bfloat16"})
    with (
        caplog.at_level(logging.WARNING, logger="gyre_xfer.subscriber"),
        Subscriber(tr, SubscriberConfig(publisher.address, pinning=rec)) as sub,
    ):
        snap = sub.pull()
        assert not snap.pinned and not sub.staging_pinned
        check_exact(snap.arrays, sent)
        assert sub.pull().version == snap.version  # no second attempt on the same buffer
    assert [e[0] for e in rec.events] == ["pin"]  # and no unpin of what was never pinned
    assert "stays pageable" in caplog.text and "driver said no" in caplog.text
    tr.close()


def test_publisher_pins_each_slot_once_and_unpins_before_release() -> None:
    rec = Recorder()
    tr = RecordingTransport(rec)
    pub = Publisher(tr, PublisherConfig(pinning=rec))  # type: ignore[arg-type]
    sub_tr = open_transport(Config(kind="shm"))
    sub = Subscriber(sub_tr, SubscriberConfig(pub.address))
    try:
        for seed in range(4):  # two slots, used in turn: each pinned once
            sent = weights(32, seed)
            pub.publish(sent, {"w": "bfloat16"})
            check_exact(sub.pull().arrays, sent)
        assert [e[0] for e in rec.events] == ["pin", "pin"]
        big = weights(2048, 9)  # the slot written next grows: unpinned, released, re-pinned
        pub.publish(big, {"w": "bfloat16"})
        check_exact(sub.pull().arrays, big)
        assert [e[0] for e in rec.events] == ["pin", "pin", "unpin", "unregister", "pin"]
        assert rec.events[2][1] == rec.events[3][1] in {rec.events[0][1], rec.events[1][1]}
    finally:
        sub.close()
        pub.close()
    closing = rec.events[5:]
    assert sorted(e[0] for e in closing) == ["unpin", "unpin", "unregister", "unregister"]
    for rid in {e[1] for e in closing}:  # each slot unpinned before it is unregistered
        assert [e[0] for e in closing if e[1] == rid] == ["unpin", "unregister"]
    assert not rec.pinned
    tr.inner.close()
    sub_tr.close()


def test_publisher_with_a_refused_pin_still_serves_exact_bytes(caplog: pytest.LogCaptureFixture) -> None:
    rec = Recorder(refuse=True)
    tr = open_transport(Config(kind="shm"))
    sub_tr = open_transport(Config(kind="shm"))
    with (
        caplog.at_level(logging.WARNING, logger="gyre_xfer.publisher"),
        Publisher(tr, PublisherConfig(pinning=rec)) as pub,
        Subscriber(sub_tr, SubscriberConfig(pub.address)) as sub,
    ):
        sent = weights(128, 5)
        pub.publish(sent, {"w": "bfloat16"})
        check_exact(sub.pull().arrays, sent)  # checksums verified too
    assert [e[0] for e in rec.events] == ["pin"]
    assert "stays pageable" in caplog.text
    tr.close()
    sub_tr.close()


def test_host_pinning_is_none_for_the_cpu() -> None:
    assert host_pinning("cpu") is None
    torch = pytest.importorskip("torch")
    assert host_pinning(torch.device("cpu")) is None
    if not torch.cuda.is_available():
        assert host_pinning("cuda") is None  # CUDA unusable: pageable, with a warning
