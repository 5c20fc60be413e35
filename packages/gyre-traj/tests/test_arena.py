"""Where a tree's token ids live once they outgrow its first array: an `Arena` of `gyre_traj._arena` (a
reserved range of address space, grown in place and recycled; POSIX, with the extension built), else a
numpy array grown 4x at a time. Growing keeps what is stored and every view taken before; a tree reads the same either
way."""

from __future__ import annotations

import gc
import os
import shutil
import sysconfig
import tracemalloc
from typing import Any

import numpy as np
import pytest
from gyre_traj import native
from gyre_traj.tree import ExecutionTree

from .helpers import OUT, SYS, call, ids

PROMPT = ids(SYS, *range(40))  # past a first array of 16 ids

needs_arena = pytest.mark.skipif(native.arena_type is None, reason="no native Arena here")
ARENA = native.arena_type


def _owner(t: ExecutionTree) -> Any:
    """What holds the tree's ids: the end of numpy's `base` chain (None: a numpy array's own)."""
    base: Any = t.ids
    while isinstance(base, (np.ndarray, memoryview)):
        base = base.obj if isinstance(base, memoryview) else base.base
    return base


def _in_arena(t: ExecutionTree) -> bool:
    """Whether the tree's ids are a view of a native `Arena`."""
    return ARENA is not None and isinstance(_owner(t), ARENA)


def _grown_tree(calls: int = 40, size: int = 3000) -> ExecutionTree:
    """A tree whose arena grew several times: a first call, then `calls` agent's next calls."""
    t = ExecutionTree("e", capacity=16)
    t.add(call("c0", PROMPT, ids(OUT, 1)))
    prev, length = "c0", len(PROMPT) + 1
    for k in range(1, calls + 1):
        rest = list(range(10_000 + k * size, 10_000 + (k + 1) * size))
        t.add(call(f"c{k}", None, ids(OUT, k % 7), delta=(prev, length, rest)))
        prev, length = f"c{k}", length + size + 1
    return t


@needs_arena
def test_an_arena_grows_in_place_and_views_taken_before_stay_valid() -> None:
    assert native.arena_type is not None
    a = native.arena_type(64)
    before = np.frombuffer(a, np.int32)
    before[:] = np.arange(16)
    address = before.ctypes.data
    assert a.grow(1 << 22) and a.nbytes == 1 << 22
    after = np.frombuffer(a, np.int32)
    assert after.ctypes.data == address and after.shape[0] == 1 << 20
    assert after[:16].tolist() == list(range(16)) and before.tolist() == list(range(16))
    after[-1] = 7  # the grown tail is writable
    assert a.grow(100) and a.nbytes == 1 << 22  # never shrinks
    assert not a.grow(a.reserved + 1) and a.nbytes == 1 << 22  # past the reservation: nothing changes
    with pytest.raises(ValueError):
        a.grow(-1)
    with pytest.raises(ValueError):
        native.arena_type(a.reserved + 1)


@needs_arena
def test_a_dropped_arena_is_recycled_for_the_next() -> None:
    assert native.arena_type is not None
    a = native.arena_type(1 << 20)
    view = np.frombuffer(a, np.uint8)
    view[:] = 1  # written: its pages are mapped now
    address = view.ctypes.data
    del view, a
    gc.collect()
    b = native.arena_type(1 << 16)
    assert np.frombuffer(b, np.uint8).ctypes.data == address and b.nbytes == 1 << 16


@needs_arena
def test_tracemalloc_counts_what_an_arena_made_writable() -> None:
    assert native.arena_type is not None
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        a = native.arena_type(1 << 20)
        assert tracemalloc.get_traced_memory()[0] - base >= 1 << 20
        a.grow(3 << 20)
        assert tracemalloc.get_traced_memory()[0] - base >= 3 << 20
        del a
        assert tracemalloc.get_traced_memory()[0] - base < 1 << 16
    finally:
        tracemalloc.stop()


@needs_arena
def test_a_tree_moves_into_an_arena_once_and_never_copies_again() -> None:
    t = ExecutionTree("e", capacity=16)
    t.add(call("c0", PROMPT, ids(OUT, 1)))  # past its first array: into an arena
    assert _in_arena(t)
    address = t.ids.ctypes.data
    held = t.ids[:5]  # a caller's view into the arena
    t.add(call("c1", None, [], delta=("c0", len(PROMPT) + 1, list(range(5, 2_000_005)))))
    assert t.ids.ctypes.data == address  # grew to 2M ids in place
    assert held.tolist() == PROMPT[:5]
    assert t.call_sequence("c1")[0][-3:].tolist() == [2_000_002, 2_000_003, 2_000_004]


def test_trees_are_the_same_with_and_without_arenas() -> None:
    with native.use_native(False):
        plain = _grown_tree()
        assert not _in_arena(plain)
    arena = _grown_tree()
    assert _in_arena(arena) == (ARENA is not None)
    for name in ("ids", "parent", "depth", "policy", "logprob", "version"):
        assert np.array_equal(getattr(plain, name), getattr(arena, name)), name
    assert plain.calls == arena.calls


def test_a_tree_grows_into_numpy_arrays_when_no_arena_can_be_reserved(monkeypatch: Any) -> None:
    def refuse(nbytes: int) -> Any:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(native, "arena_type", refuse)
    t = _grown_tree(calls=5)
    assert not _in_arena(t)
    assert t.call_sequence("c5")[0][-1] == 10_000 + 6 * 3000 - 1


class _SmallArena:
    """An arena that refuses to grow past `limit` bytes (as a real one past its reserved range)."""

    def __init__(self, nbytes: int, limit: int = 1 << 16) -> None:
        self.limit = limit
        self.buf = bytearray(limit)
        self.nbytes = nbytes

    def __buffer__(self, flags: int) -> memoryview:
        return memoryview(self.buf)[: self.nbytes]

    def grow(self, nbytes: int) -> bool:
        if nbytes > self.limit:
            return False
        self.nbytes = max(self.nbytes, nbytes)
        return True


def test_a_tree_past_its_arenas_range_moves_to_a_numpy_array(monkeypatch: Any) -> None:
    monkeypatch.setattr(native, "arena_type", _SmallArena)
    t = _grown_tree(calls=20, size=1000)
    assert not isinstance(_owner(t), _SmallArena)
    seq = t.call_sequence("c20")[0]
    assert seq[-1000:].tolist() == list(range(10_000 + 20 * 1000, 10_000 + 21 * 1000))
    assert seq[: len(PROMPT)].tolist() == PROMPT


def test_the_arena_extension_is_built_where_a_compiler_is() -> None:
    """On a POSIX system where gyre-traj was installed with a C compiler at hand, `gyre_traj._arena` is
    there (the tests above are skipped without it: this one says why, rather than passing)."""
    if os.environ.get(native.ENV) == "0" or os.name != "posix":
        pytest.skip(f"{native.ENV}=0" if os.name == "posix" else "arenas are POSIX only")
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    assert native.ARENA is not None or shutil.which(compiler) is None, "a C compiler is here: build _arena"
