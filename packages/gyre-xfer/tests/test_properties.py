"""Invariants checked over many generated cases: a KV move reports every block exactly as a plain model
predicts and moves exactly the in-range blocks' bytes; snapshot buckets cover every byte once."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from gyre_xfer.kv import KvPool
from gyre_xfer.protocol import Manifest, RegionDesc, TensorEntry, TransportKind
from gyre_xfer.subscriber import _buckets
from gyre_xfer.transport import Config, EntryStatus, Transport, open_transport
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

LAYERS, SRC_BLOCKS, DST_BLOCKS, NBYTES = 2, 24, 16, 256


@pytest.fixture(scope="module", params=["shm", pytest.param("mooncake", marks=pytest.mark.mooncake)])
def pools(request: pytest.FixtureRequest) -> Iterator[tuple[KvPool, KvPool]]:
    a: Transport = open_transport(Config(kind=str(request.param)))
    b: Transport = open_transport(Config(kind=str(request.param)))
    src = KvPool.allocate(b, LAYERS, SRC_BLOCKS, NBYTES)
    for layer in range(LAYERS):
        for kv in range(2):
            for blk in range(SRC_BLOCKS):
                src.block(layer, kv, blk)[:] = (layer * 2 + kv) * 50 + blk
    dst = KvPool.allocate(a, LAYERS, DST_BLOCKS, NBYTES)
    yield src, dst
    a.close()
    b.close()


@st.composite
def moves(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    n = draw(st.integers(0, 12))
    dst = draw(st.lists(st.integers(-2, DST_BLOCKS + 2), min_size=n, max_size=n, unique=True))
    # runs of adjacent ids on both sides are common in practice: steer toward them
    start = draw(st.integers(-1, SRC_BLOCKS))
    src = draw(
        st.one_of(
            st.just([start + i for i in range(n)]),
            st.lists(st.integers(-2, SRC_BLOCKS + 2), min_size=n, max_size=n),
        )
    )
    return src, dst


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(moves())
@example(([0, 1, 2, 3], [5, 6, 7, 8]))  # one coalesced run
@example(([SRC_BLOCKS - 1, SRC_BLOCKS], [0, 1]))  # a run that steps out of range
def test_kv_move_matches_a_plain_model(
    pools: tuple[KvPool, KvPool], move: tuple[list[int], list[int]]
) -> None:
    src, dst = pools
    src_ids, dst_ids = move
    for layer in range(LAYERS):
        for kv in range(2):
            for blk in range(DST_BLOCKS):
                dst.block(layer, kv, blk)[:] = 255
    res = dst.pull(src.describe(), src_ids, dst_ids)
    expected = [
        EntryStatus.OK if 0 <= s < SRC_BLOCKS and 0 <= d < DST_BLOCKS else EntryStatus.OUT_OF_RANGE
        for s, d in zip(src_ids, dst_ids, strict=True)
    ]
    assert [b.status for b in res.blocks] == expected
    assert [(b.src_block, b.dst_block) for b in res.blocks] == list(zip(src_ids, dst_ids, strict=True))
    moved = {d: s for s, d, st_ in zip(src_ids, dst_ids, expected, strict=True) if st_ is EntryStatus.OK}
    for layer in range(LAYERS):
        for kv in range(2):
            for blk in range(DST_BLOCKS):
                want = (layer * 2 + kv) * 50 + moved[blk] if blk in moved else 255
                assert (dst.block(layer, kv, blk) == want).all()
    assert res.nbytes == len(moved) * 2 * LAYERS * NBYTES


@given(st.lists(st.integers(0, 5000), max_size=8), st.integers(1, 3000))
def test_buckets_cover_every_byte_once(sizes: list[int], bucket: int) -> None:
    tensors = []
    pos = 0
    for i, n in enumerate(sizes):
        tensors.append(TensorEntry(f"t{i}", "uint8", (n,), pos, n, -1))
        pos += n + 3
    m = Manifest(1, "x", TransportKind.SHM, "shm:h", RegionDesc(1, pos, 0, "s"), tuple(tensors))
    tr = open_transport(Config(kind="shm"))
    try:
        region = tr.alloc(max(pos, 1))
        targets = {t.name: (np.empty(0, np.uint8), region, t.offset) for t in tensors}
        by_name = {t.name: t for t in tensors}
        covered = np.zeros(max(pos, 1), np.int32)
        finished: list[str] = []
        for ops, owners in _buckets(m.tensors, targets, m, bucket):
            assert sum(op.length for op in ops) <= bucket + max((op.length for op in ops), default=0)
            for op, (name, pos) in zip(ops, owners, strict=True):
                assert op.length <= bucket and op.local_offset == op.remote_offset
                assert op.remote_offset == by_name[name].offset + pos  # where the piece lies in its tensor
                covered[op.remote_offset : op.remote_offset + op.length] += 1
                if pos + op.length == by_name[name].nbytes:
                    finished.append(name)
        assert finished == [t.name for t in tensors]  # each tensor's pieces in order, its last one once
        for t in tensors:
            assert (covered[t.offset : t.offset + t.nbytes] == 1).all()
        assert covered.sum() == sum(sizes)
    finally:
        tr.close()
