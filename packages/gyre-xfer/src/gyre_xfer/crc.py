"""crc32 of large buffers in pieces: each piece hashed on its own (zlib releases the GIL, so pieces hash
on several threads at once), then the pieces' crcs combined into the crc32 of the whole buffer, equal to
`zlib.crc32` of it.

Combining: appending `n` bytes to a message changes its crc register linearly over GF(2), so
`crc32(a + b) == Z(len(b)) crc32(a) XOR crc32(b)`, where `Z(n)` is the 32 x 32 bit matrix that feeds `n`
zero bytes through the register (the initial and final inversions of crc32 cancel between the three
crcs). `Z(n)` is built from the operator for one zero bit of the reflected polynomial 0xEDB88320, squared
to get the operators for 1, 2, 4, ... bytes, multiplied together for the set bits of `n`; the result is
cached per `n`, so combining many pieces of one length costs one matrix-vector product each.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Iterable
from concurrent.futures import Executor, Future

import numpy as np

POLY = 0xEDB88320
"""crc32's polynomial, bit-reflected (the lowest bit is the x^31 coefficient)."""

HASH_PIECE_BYTES = 16 << 20
"""Default piece size for hashing one large buffer on several threads (about 8 ms of one core's crc32)."""

Matrix = tuple[int, ...]
"""A 32 x 32 bit matrix over GF(2) as its 32 columns: entry i is the image of the vector with bit i set."""


def _apply(mat: Matrix, vec: int) -> int:
    """mat x vec over GF(2): the XOR of the columns picked by the set bits of vec."""
    out = 0
    i = 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _compose(a: Matrix, b: Matrix) -> Matrix:
    """a x b: apply b, then a."""
    return tuple(_apply(a, col) for col in b)


def _one_zero_bit() -> Matrix:
    """The register after one more zero bit: shift right by one, XOR in the polynomial when the bit
    shifted out was set."""
    return (POLY, *(1 << (i - 1) for i in range(1, 32)))


@functools.cache
def _zero_bytes_pow2(k: int) -> Matrix:
    """Z(2**k): the operator for 2**k zero bytes (k = 0: eight zero bits)."""
    if k == 0:
        m = _one_zero_bit()
        for _ in range(3):  # 1 -> 2 -> 4 -> 8 bits
            m = _compose(m, m)
        return m
    half = _zero_bytes_pow2(k - 1)
    return _compose(half, half)


@functools.lru_cache(maxsize=4096)
def zero_bytes_operator(n: int) -> Matrix:
    """Z(n): the operator feeding `n` zero bytes through the crc register (n >= 1)."""
    if n < 1:
        raise ValueError(f"no operator for {n} zero bytes")
    out: Matrix | None = None
    k = 0
    while n:
        if n & 1:
            step = _zero_bytes_pow2(k)
            out = step if out is None else _compose(step, out)
        n >>= 1
        k += 1
    assert out is not None
    return out


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The crc32 of `a + b` from `crc1 = crc32(a)`, `crc2 = crc32(b)` and `len2 = len(b)`."""
    if len2 < 0:
        raise ValueError(f"negative length {len2}")
    if len2 == 0:
        return crc1  # b is empty, so crc2 == 0
    return _apply(zero_bytes_operator(len2), crc1) ^ crc2


def crc32_of_pieces(pieces: Iterable[tuple[int, int]]) -> int:
    """The crc32 of consecutive pieces given as (crc32 of the piece, its length), in order."""
    crc = 0  # crc32(b"")
    for piece_crc, n in pieces:
        crc = crc32_combine(crc, piece_crc, n)
    return crc


def split(nbytes: int, piece: int) -> list[tuple[int, int]]:
    """(start, stop) of consecutive pieces of at most `piece` bytes covering [0, nbytes); one empty
    piece for an empty buffer."""
    if piece < 1:
        raise ValueError(f"piece size must be positive, got {piece}")
    if nbytes == 0:
        return [(0, 0)]
    return [(s, min(s + piece, nbytes)) for s in range(0, nbytes, piece)]


def submit_pieces(pool: Executor, buf: np.ndarray, piece: int) -> list[tuple[Future[int], int]]:
    """Hash `buf` (a contiguous uint8 view) in pieces on `pool`: (future crc32, length) per piece."""
    return [(pool.submit(zlib.crc32, buf[s:e]), e - s) for s, e in split(buf.nbytes, piece)]


def combine_futures(pieces: Iterable[tuple[Future[int], int]]) -> int:
    """Wait for the pieces' crcs (from `submit_pieces`) and combine them into the whole buffer's crc32."""
    return crc32_of_pieces((f.result(), n) for f, n in pieces)
