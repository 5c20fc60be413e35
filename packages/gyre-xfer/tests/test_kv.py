"""KV blocks between two real processes: byte-exact pulls and pushes over Mooncake TCP and shared memory,
and a result for every block (out-of-range ids are reported, the others still arrive)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import msgspec
import numpy as np
import pytest
from gyre_xfer.errors import ShapeMismatchError
from gyre_xfer.kv import KvPool
from gyre_xfer.protocol import KvPoolDesc
from gyre_xfer.transport import Config, EntryStatus, Transport, open_transport

from .conftest import Peer
from .peer_proc import block_pattern

LAYERS, BLOCKS, NBYTES = 3, 64, 4096


@pytest.fixture(params=[pytest.param("mooncake", marks=pytest.mark.mooncake), "shm"])
def transport(request: pytest.FixtureRequest) -> Iterator[Transport]:
    tr = open_transport(Config(kind=str(request.param), progress_timeout_s=2))
    yield tr
    tr.close()


def start_pool(spawn: Callable[..., Peer], kind: str) -> KvPoolDesc:
    peer = spawn("kvpool", kind, layers=LAYERS, blocks=BLOCKS, block_nbytes=NBYTES)
    return msgspec.json.decode(peer.info, type=KvPoolDesc)


def test_pull_is_byte_exact_per_block(spawn: Callable[..., Peer], transport: Transport) -> None:
    src = start_pool(spawn, transport.kind.name.lower())
    pool = KvPool.allocate(transport, LAYERS, 32, NBYTES)
    src_ids = [5, 6, 7, 40, 2, 63]
    dst_ids = [0, 1, 2, 3, 9, 31]
    res = pool.pull(src, src_ids, dst_ids)
    assert res.ok and res.arrived == dst_ids
    assert res.nbytes == len(src_ids) * 2 * LAYERS * NBYTES
    for s, d in zip(src_ids, dst_ids, strict=True):
        for layer in range(LAYERS):
            for kv in range(2):
                assert np.array_equal(pool.block(layer, kv, d), block_pattern(layer, kv, s, NBYTES))
    assert not pool.block(0, 0, 4).any()  # untouched blocks stay untouched
    pool.close()


def test_out_of_range_blocks_are_reported_and_the_rest_arrive(
    spawn: Callable[..., Peer], transport: Transport
) -> None:
    src = start_pool(spawn, transport.kind.name.lower())
    pool = KvPool.allocate(transport, LAYERS, 8, NBYTES)
    res = pool.pull(src, [1, 64, 3, -1, 4], [0, 1, 2, 3, 8])
    got = [(b.src_block, b.dst_block, b.status) for b in res.blocks]
    assert got == [
        (1, 0, EntryStatus.OK),
        (64, 1, EntryStatus.OUT_OF_RANGE),
        (3, 2, EntryStatus.OK),
        (-1, 3, EntryStatus.OUT_OF_RANGE),
        (4, 8, EntryStatus.OUT_OF_RANGE),
    ]
    assert np.array_equal(pool.block(2, 1, 2), block_pattern(2, 1, 3, NBYTES))
    assert not pool.block(0, 0, 1).any()
    pool.close()


def test_push_into_an_engine_style_pool(spawn: Callable[..., Peer], transport: Transport) -> None:
    """The receiving side registered its own per-layer K and V arrays (as an engine would)."""
    src = start_pool(spawn, transport.kind.name.lower())
    k = [np.zeros((BLOCKS, NBYTES // 4), np.float32) for _ in range(LAYERS)]
    v = [np.zeros((BLOCKS, NBYTES // 4), np.float32) for _ in range(LAYERS)]
    if transport.kind.name == "SHM":  # peers can only address memory the shm transport allocated
        theirs = KvPool.from_buffers(transport, k, v)
        res = KvPool.allocate(transport, LAYERS, 4, NBYTES).push(theirs.describe(), [0], [0])
        assert [b.status for b in res.blocks] == [EntryStatus.FAILED]
        assert "not in shared memory" in res.detail
        return
    mine = KvPool.from_buffers(transport, k, v)
    # pull peer blocks into the engine-style pool, then push two of them back into peer blocks
    assert mine.pull(src, [10, 11, 12], [0, 1, 2]).ok
    assert np.array_equal(k[1][1].view(np.uint8), block_pattern(1, 0, 11, NBYTES))
    assert np.array_equal(v[2][2].view(np.uint8), block_pattern(2, 1, 12, NBYTES))
    res = mine.push(src, [0, 1], [20, 21])
    assert res.ok
    back = KvPool.allocate(transport, LAYERS, 2, NBYTES)
    assert back.pull(src, [20, 21], [0, 1]).ok
    assert np.array_equal(back.block(0, 0, 1), block_pattern(0, 0, 11, NBYTES))
    mine.close()
    back.close()


def test_mismatched_layouts_are_rejected(spawn: Callable[..., Peer], transport: Transport) -> None:
    src = start_pool(spawn, transport.kind.name.lower())
    other = KvPool.allocate(transport, LAYERS, 4, NBYTES * 2)
    with pytest.raises(ShapeMismatchError, match="4096-byte blocks"):
        other.pull(src, [0], [0])
    with pytest.raises(ShapeMismatchError, match="repeat"):
        KvPool.allocate(transport, LAYERS, 4, NBYTES).pull(src, [0, 1], [2, 2])
    with pytest.raises(ShapeMismatchError, match="2 local blocks but 1"):
        KvPool.allocate(transport, LAYERS, 4, NBYTES).pull(src, [0], [1, 2])
