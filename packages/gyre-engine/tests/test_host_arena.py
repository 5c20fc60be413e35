"""The host tier's arena: spans taken plane by plane from one buffer, never two live owners of a byte, a
span read through a lease never reused under its reader, and every byte back in the free list once
neither its entry nor a lease holds it."""

from __future__ import annotations

import threading

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

torch = pytest.importorskip("torch")
from gyre_engine.server.batch import RowKV  # noqa: E402
from gyre_engine.server.host_arena import HostArena, HostRowKV  # noqa: E402

ARENA = 4096


def kv(n: int, layers: int, fill: int, dtype: torch.dtype = torch.bfloat16) -> RowKV:
    """`layers` layers of KV of `n` tokens (2 heads of 4), every element of plane p `fill + p`."""

    def plane(p: int) -> torch.Tensor:
        return torch.full((1, 2, n, 4), float(fill + p), dtype=dtype)

    return RowKV([plane(i) for i in range(layers)], [plane(layers + i) for i in range(layers)])


def same(a: RowKV, b: RowKV) -> bool:
    return all(torch.equal(x, y) for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values), strict=True))


def test_a_placed_entry_is_a_copy_in_the_arena_and_its_bytes_come_back() -> None:
    arena = HostArena(ARENA)
    src = kv(8, 2, 10)
    got = arena.place(src)
    assert got is not None and same(got, src) and isinstance(got, HostRowKV)
    assert got.keys[0].data_ptr() % 4096 == 0  # the first range: the buffer starts on a page
    src.keys[0].zero_()
    assert not torch.equal(got.keys[0], src.keys[0])  # a copy, not the source
    assert arena.free_bytes() == ARENA - src.nbytes()
    base = got.keys[0].untyped_storage().data_ptr()
    assert all(t.data_ptr() >= base for t in (*got.keys, *got.values))
    arena.release(got)
    assert arena.free_bytes() == ARENA
    assert arena.place(kv(2048, 1, 0)) is None  # 64 KiB: larger than the arena, nothing taken
    assert arena.free_bytes() == ARENA


def test_an_entry_fills_the_holes_others_left_plane_by_plane() -> None:
    arena = HostArena(ARENA)
    # 16 entries of two 128-byte planes: the whole arena
    parts = [arena.place(kv(8, 1, 10 * i)) for i in range(16)]
    assert all(p is not None for p in parts) and arena.free_bytes() == 0
    for p in parts[::2]:  # every other one goes: 8 holes of 256 bytes
        assert p is not None
        arena.release(p)
    big = kv(64, 4, 500)  # 2 KiB, as free, but in planes of 1 KiB: no hole takes one
    assert arena.place(big) is None and arena.free_bytes() == 2048
    fits = kv(16, 4, 700)  # 2 KiB in 8 planes of 256 bytes: one a hole
    got = arena.place(fits)
    assert got is not None and same(got, fits) and arena.free_bytes() == 0
    assert all(same(p, kv(8, 1, 10 * i)) for i, p in enumerate(parts) if i % 2 and p is not None)


def test_a_lease_keeps_the_span_until_the_last_reader_lets_go() -> None:
    arena = HostArena(512)
    entry = arena.place(kv(8, 1, 1))  # 256 bytes
    assert entry is not None
    lease = arena.lease(entry, 5)
    crop = lease.crop(3)
    del lease
    arena.release(entry)  # the entry leaves; the crop still reads its span
    assert HostArena.read(entry) and arena.free_bytes() == 256
    other = arena.place(kv(16, 1, 2))  # 512 bytes: does not fit beside the read span
    assert other is None
    done = threading.Event()

    def drop() -> None:  # a lease ends on the thread that drops it (an offer's copy thread)
        nonlocal crop
        assert torch.equal(crop.keys[0], kv(3, 1, 1).keys[0])
        del crop
        done.set()

    threading.Thread(target=drop).start()
    assert done.wait(10)
    assert not HostArena.read(entry) and arena.free_bytes() == 512
    assert arena.place(kv(16, 1, 2)) is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_planes_keep_their_dtype_and_shape(dtype: torch.dtype) -> None:
    arena = HostArena(1 << 16)
    src = kv(7, 3, 5, dtype)
    got = arena.place(src)
    assert got is not None and same(got, src)
    assert all(t.dtype == dtype and t.shape == (1, 2, 7, 4) for t in (*got.keys, *got.values))


class ArenaMachine(RuleBasedStateMachine):
    """Entries placed, leased, cropped, released and let go in any order: the free list and the live
    spans never overlap and add up to the arena, and every live view reads what was placed."""

    def __init__(self) -> None:
        super().__init__()
        self.arena = HostArena(ARENA)
        self.entries: list[tuple[HostRowKV, RowKV]] = []  # held by the "cache"
        self.readers: list[tuple[HostRowKV, RowKV]] = []  # leases (and crops of them)
        self.fill = 0

    @rule(n=st.integers(1, 40), layers=st.integers(1, 3))
    def place(self, n: int, layers: int) -> None:
        self.fill += 10
        src = kv(n, layers, self.fill)
        before = self.arena.free_bytes()
        got = self.arena.place(src)
        if got is None:
            assert self.arena.free_bytes() == before  # nothing taken when it does not fit
        else:
            assert same(got, src)
            self.entries.append((got, src))

    @precondition(lambda self: self.entries)
    @rule(data=st.data())
    def lease(self, data: st.DataObject) -> None:
        got, src = data.draw(st.sampled_from(self.entries))
        n = data.draw(st.integers(1, got.length))
        leased = self.arena.lease(got, n)
        if data.draw(st.booleans()):
            k = data.draw(st.integers(1, n))
            leased, n = leased.crop(k), k
        self.readers.append((leased, src.crop(n)))

    @precondition(lambda self: self.entries)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.entries) - 1))
        got, _ = self.entries.pop(i)
        self.arena.release(got)

    @precondition(lambda self: self.readers)
    @rule(data=st.data())
    def let_go(self, data: st.DataObject) -> None:
        self.readers.pop(data.draw(st.integers(0, len(self.readers) - 1)))

    @invariant()
    def views_read_what_was_placed(self) -> None:
        for got, src in self.entries + self.readers:
            assert same(got, src)

    @invariant()
    def free_and_live_ranges_partition_the_arena(self) -> None:
        live = {id(g.span): g.span for g, _ in self.entries + self.readers if g.span is not None}
        ranges = sorted([r for s in live.values() for r in s.ranges] + self.arena.free_ranges())
        pos = 0
        for start, end in ranges:
            assert start >= pos and end > start
            pos = end
        assert pos <= ARENA
        used = sum(e - s for sp in live.values() for s, e in sp.ranges)
        assert self.arena.free_bytes() + used == ARENA


TestArena = ArenaMachine.TestCase
TestArena.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
