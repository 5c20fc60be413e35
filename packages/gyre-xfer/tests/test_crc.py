"""crc32 in pieces (`gyre_xfer.crc`): combining two crcs gives the crc of the concatenation, and a buffer
hashed in pieces on several threads has exactly zlib's crc32, whatever its size next to the piece size;
the publisher's manifest crcs stay zlib's, and a subscriber verifying in pieces still catches a bad byte."""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from gyre_xfer.crc import (
    HASH_PIECE_BYTES,
    combine_futures,
    crc32_combine,
    crc32_of_pieces,
    split,
    submit_pieces,
    zero_bytes_operator,
)
from gyre_xfer.errors import ChecksumError
from gyre_xfer.publisher import Publisher
from gyre_xfer.subscriber import Subscriber, SubscriberConfig
from gyre_xfer.transport import BatchResult, Config, Op, Transport, open_transport
from hypothesis import example, given
from hypothesis import strategies as st


@pytest.fixture(scope="module")
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(4) as p:
        yield p


@given(st.binary(max_size=2048), st.binary(max_size=2048))
@example(b"", b"")
@example(b"abc", b"")
@example(b"", b"abc")
def test_combine_gives_the_crc_of_the_concatenation(a: bytes, b: bytes) -> None:
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@given(st.binary(max_size=64), st.integers(0, 3 << 20), st.integers(0, 255))
@example(b"x", HASH_PIECE_BYTES, 7)
@example(b"", 1, 0)
def test_combine_over_long_second_pieces(a: bytes, n: int, fill: int) -> None:
    """Lengths far past one matrix squaring (the operator for n zero bytes is built from its bits)."""
    b = bytes([fill]) * n
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), n) == zlib.crc32(a + b)


@given(st.binary(max_size=4096), st.lists(st.integers(0, 4096), max_size=6))
def test_any_cut_into_pieces_combines_to_the_whole(data: bytes, cuts: list[int]) -> None:
    bounds = sorted({0, len(data), *(min(c, len(data)) for c in cuts)})
    pieces = [data[s:e] for s, e in itertools.pairwise(bounds)]
    assert crc32_of_pieces((zlib.crc32(p), len(p)) for p in pieces) == zlib.crc32(data)


def test_a_cached_operator_is_the_same_operator() -> None:
    zero_bytes_operator.cache_clear()
    first = zero_bytes_operator(HASH_PIECE_BYTES)
    assert zero_bytes_operator(HASH_PIECE_BYTES) is first
    assert zero_bytes_operator.cache_info().hits == 1
    with pytest.raises(ValueError):
        zero_bytes_operator(0)
    with pytest.raises(ValueError):
        crc32_combine(1, 2, -1)


def _sizes_around(piece: int) -> Sequence[int]:
    return sorted({max(0, k * piece + d) for k in range(4) for d in (-2, -1, 0, 1, 2)})


@pytest.mark.parametrize("piece", [1, 7, 4096, 4099])
def test_piecewise_hash_is_zlibs_around_piece_boundaries(pool: ThreadPoolExecutor, piece: int) -> None:
    rng = np.random.default_rng(piece)
    for n in _sizes_around(piece):
        buf = rng.integers(0, 256, n, dtype=np.uint8)
        assert combine_futures(submit_pieces(pool, buf, piece)) == zlib.crc32(buf), n
        got = submit_pieces(pool, buf, piece)
        assert [length for _, length in got] == [e - s for s, e in split(n, piece)]
        assert sum(length for _, length in got) == n
        assert crc32_of_pieces((f.result(), length) for f, length in got) == zlib.crc32(buf), n


def test_piecewise_hash_at_the_default_piece_size(pool: ThreadPoolExecutor) -> None:
    buf = np.random.default_rng(3).integers(0, 256, 2 * HASH_PIECE_BYTES + 12345, dtype=np.uint8)
    assert combine_futures(submit_pieces(pool, buf, HASH_PIECE_BYTES)) == zlib.crc32(buf)
    assert len(split(buf.nbytes, HASH_PIECE_BYTES)) == 3


def test_split_covers_every_byte_once() -> None:
    assert split(0, 5) == [(0, 0)]
    assert split(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert split(8, 4) == [(0, 4), (4, 8)]
    with pytest.raises(ValueError):
        split(10, 0)


def _weights(seed: int) -> dict[str, np.ndarray]:
    """Random bytes (a piece hashed out of order would give another crc), sizes around 16 MiB pieces."""
    rng = np.random.default_rng(seed)
    sizes = {"embed": 2 * HASH_PIECE_BYTES + 4099, "edge": HASH_PIECE_BYTES, "small": 12345, "empty": 0}
    return {name: rng.integers(0, 256, n, dtype=np.uint8) for name, n in sizes.items()}


def test_publisher_manifest_crcs_are_zlibs_and_piecewise_pulls_verify_them() -> None:
    """Tensors over one hashing piece are hashed in pieces by the publisher and by the subscriber (with
    the default pieces, and with odd pieces and buckets that do not line up with them); the manifest still
    carries zlib.crc32 of each whole tensor and every pull is byte-exact."""
    pub_tr, sub_tr = open_transport(Config(kind="shm")), open_transport(Config(kind="shm"))
    pub = Publisher(pub_tr)
    weights = _weights(1)
    try:
        v = pub.publish(weights)
        for cfg in (
            SubscriberConfig(pub.address),
            SubscriberConfig(pub.address, bucket_bytes=5 << 20, hash_piece_bytes=1_000_003),
            SubscriberConfig(pub.address, bucket_bytes=1 << 20, hash_piece_bytes=4097, hash_threads=3),
        ):
            with Subscriber(sub_tr, cfg) as sub:
                snap = sub.pull(min_version=v)
                for t in snap.manifest.tensors:
                    assert t.crc32 == zlib.crc32(weights[t.name]), t.name
                    assert np.array_equal(snap.arrays[t.name], weights[t.name]), t.name
    finally:
        pub.close()
        pub_tr.close()
        sub_tr.close()


class _Corrupting:
    """A transport that flips one byte of the destination after the batch holding it has landed (before
    the subscriber hashes it)."""

    def __init__(self, inner: Transport, at: int) -> None:
        self.inner = inner
        self.at = at

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def read(self, peer: str, ops: Sequence[Op], timeout_s: float | None = None) -> BatchResult:
        res = self.inner.read(peer, ops, timeout_s)
        for op in ops:
            if op.local_offset <= self.at < op.local_offset + op.length:
                assert op.region.array is not None
                op.region.array[self.at] ^= 0x40
        return res


def test_a_bad_byte_in_a_late_piece_is_caught() -> None:
    pub_tr, sub_tr = open_transport(Config(kind="shm")), open_transport(Config(kind="shm"))
    pub = Publisher(pub_tr)
    try:
        v = pub.publish(_weights(2))
        cfg = SubscriberConfig(pub.address, bucket_bytes=3 << 20, hash_piece_bytes=1 << 20)
        with Subscriber(sub_tr, cfg) as sub:
            manifest = sub.pull(min_version=v).manifest  # intact
        embed = next(t for t in manifest.tensors if t.name == "embed")
        at = embed.offset + embed.nbytes - 5  # in the tensor's last hashing piece (staging offsets = slot's)
        corrupting = _Corrupting(sub_tr, at)
        with Subscriber(corrupting, cfg) as sub, pytest.raises(ChecksumError, match="'embed' of version 1"):  # type: ignore[arg-type]
            sub.pull(min_version=v)
    finally:
        pub.close()
        pub_tr.close()
        sub_tr.close()
