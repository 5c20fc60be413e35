"""A peer killed or stopped mid-transfer gives a typed error within the configured time, never a hang.

The measured times are printed (pytest -s shows them); the bounds asserted are generous ceilings that a
hang would break, not speed targets (speed is what the benchmark measures)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import msgspec
import pytest
from gyre_xfer.errors import PeerGoneError, PeerTimeoutError
from gyre_xfer.kv import KvPool, KvTransferResult
from gyre_xfer.protocol import KvPoolDesc
from gyre_xfer.subscriber import Subscriber, SubscriberConfig
from gyre_xfer.transport import Config, EntryStatus, Transport, open_transport

from .conftest import Peer

pytestmark = pytest.mark.mooncake  # the failures of Mooncake's own TCP transport

LAYERS, BLOCKS, NBYTES = 4, 512, 64 << 10  # 256 MiB: long enough to be caught mid-transfer
PROGRESS_S = 2


@pytest.fixture
def transport() -> Iterator[Transport]:
    tr = open_transport(Config(kind="mooncake", progress_timeout_s=PROGRESS_S, timeout_s=20.0))
    yield tr
    tr.close()


def _pool_peer(spawn: Callable[..., Peer]) -> tuple[Peer, KvPoolDesc]:
    peer = spawn("kvpool", "mooncake", layers=LAYERS, blocks=BLOCKS, block_nbytes=NBYTES)
    return peer, msgspec.json.decode(peer.info, type=KvPoolDesc)


def _pull_until_failure(
    pool: KvPool, src: KvPoolDesc, peer: Peer, sig: int, deadline_s: float = 60.0
) -> tuple[KvTransferResult, float]:
    """Pull every block again and again; after the first pull starts, send `sig` to the peer."""
    ids = list(range(BLOCKS))
    fired = threading.Event()

    def fire() -> None:
        time.sleep(0.05)
        os.kill(peer.proc.pid, sig)
        fired.set()

    threading.Thread(target=fire, daemon=True).start()
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        res = pool.pull(src, ids, ids)
        if not res.ok:
            return res, res.elapsed_s
        assert not fired.is_set() or res.ok  # a pull that finished before the signal is fine
    raise AssertionError("the peer never failed")


@pytest.mark.slow
def test_killed_peer_is_peer_gone_fast(spawn: Callable[..., Peer], transport: Transport) -> None:
    peer, src = _pool_peer(spawn)
    pool = KvPool.allocate(transport, LAYERS, BLOCKS, NBYTES)
    res, took = _pull_until_failure(pool, src, peer, signal.SIGKILL)
    print(f"\nkilled peer: {len(res.blocks)} blocks reported after {took:.3f} s: {res.detail}")
    assert {b.status for b in res.blocks} == {EntryStatus.PEER_GONE}
    assert took < 3 * PROGRESS_S + 5
    # and a fresh pull against the dead peer is an immediate error, not a hang
    again = pool.pull(src, [0], [0])
    assert [b.status for b in again.blocks] == [EntryStatus.PEER_GONE]
    with pytest.raises(PeerGoneError, match="PEER_GONE"):
        transport.read(src.endpoint, [_one_op(pool, src)]).raise_for_status(src.endpoint, "pulling a block")
    pool.close()


@pytest.mark.slow
def test_stopped_peer_is_timeout_after_progress_limit(
    spawn: Callable[..., Peer], transport: Transport
) -> None:
    peer, src = _pool_peer(spawn)
    pool = KvPool.allocate(transport, LAYERS, BLOCKS, NBYTES)
    res, took = _pull_until_failure(pool, src, peer, signal.SIGSTOP)
    print(f"\nstopped peer: {len(res.blocks)} blocks reported after {took:.3f} s: {res.detail}")
    assert {b.status for b in res.blocks} <= {EntryStatus.TIMEOUT, EntryStatus.OK}
    assert EntryStatus.TIMEOUT in {b.status for b in res.blocks}
    assert 0.9 * PROGRESS_S <= took < 4 * PROGRESS_S + 5
    pool.close()


@pytest.mark.slow
def test_wrapper_deadline_bounds_a_call_mooncake_would_keep_waiting_on(spawn: Callable[..., Peer]) -> None:
    """Mooncake's own progress limit at 30 s; gyre-xfer's per-call deadline (1.5 s) still ends the wait."""
    tr = open_transport(Config(kind="mooncake", progress_timeout_s=30))
    try:
        peer, src = _pool_peer(spawn)
        pool = KvPool.allocate(tr, LAYERS, BLOCKS, NBYTES)
        assert pool.pull(src, [0], [0]).ok
        os.kill(peer.proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        res = pool.pull(src, list(range(BLOCKS)), list(range(BLOCKS)), timeout_s=1.5)
        took = time.monotonic() - t0
        print(f"\nstopped peer, 1.5 s deadline: reported after {took:.3f} s")
        assert {b.status for b in res.blocks} == {EntryStatus.TIMEOUT}
        assert took < 1.5 + 3
        with pytest.raises(PeerTimeoutError):
            tr.read(src.endpoint, [_one_op(pool, src)], timeout_s=0.5).raise_for_status(src.endpoint, "pull")
        os.kill(peer.proc.pid, signal.SIGKILL)
    finally:
        tr.close()


@pytest.mark.slow
def test_publisher_killed_mid_pull(spawn: Callable[..., Peer], transport: Transport) -> None:
    peer = spawn("publisher", "mooncake", tensors=8, tensor_bytes=32 << 20)
    cfg = SubscriberConfig(json.loads(peer.info)["control"], bucket_bytes=4 << 20, control_timeout_s=3.0)
    with Subscriber(transport, cfg) as sub:
        threading.Timer(0.05, lambda: os.kill(peer.proc.pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises((PeerGoneError, PeerTimeoutError)) as info:
            for _ in range(50):
                sub.pull()
        took = time.monotonic() - t0
        print(f"\npublisher killed: {type(info.value).__name__} after {took:.3f} s: {info.value}")
        assert took < 3 * PROGRESS_S + 10


def _one_op(pool: KvPool, src: KvPoolDesc) -> object:
    from gyre_xfer.transport import Op

    return Op(pool.regions[0], 0, src.regions[0], 0, NBYTES)
