"""gyre-traj's native live-ingest path: whether it is built, whether it is in use, and its switch.

`gyre_traj._ingest` is a C extension built with gyre-traj where a C compiler is found (an optional
part of the build: an install without a compiler gets the pure-Python path, nothing else changes). It
holds two things: `TreeState`, the base class of `ExecutionTree` (the fields a placed call writes,
in a C struct); and `extend_next`, which places a call into its tree straight from its msgpack
message: an agent's next call by a copy of its tokens, any other call of a tree that exists by the merge
`ExecutionTree._add` does (`Forest.ingest_frame` calls it first; it returns None, the tree unchanged,
for any message it is not sure of, which the Python path then takes as before). `gyre_traj._arena`, a
second one built on POSIX systems, holds `Arena`, where a tree's token ids move once they outgrow its
first array: a reserved range of address space made writable as the tree grows, so that growing never
copies what is stored, and recycled when the tree is dropped, so that the next tree writes into pages
already mapped (`ExecutionTree._reserve`; without it, a numpy array grown 4x at a time).

- `BUILT`: the extension was imported (set `GYRE_TRAJ_NATIVE=0` in the environment to import neither:
  `ExecutionTree` then stands on `PyTreeState`, its pure-Python twin, and grows numpy arrays).
- `in_use()`: `Forest.ingest_frame` tries the native path first, and trees grow into arenas;
  `use_native(False)` turns both off (and back on) at run time, as the tests do to check both paths
  give the same trees and errors.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np

ENV = "GYRE_TRAJ_NATIVE"
"""Set to 0 to leave the extension unimported (the pure-Python path, as without a compiler)."""


class PyTreeState:
    """The fields an agent's next call writes in an `ExecutionTree` (its base class), as plain slots:
    the pure-Python twin of the extension's `TreeState`, with the same names."""

    __slots__ = (
        "_ids",
        "_lps",
        "_lps_n",
        "_pend_lo",
        "_policy_count",
        "_seg_groups",
        "_seg_hi",
        "_seg_lo",
        "calls",
        "execution_id",
        "n",
        "order",
        "stats",
    )
    n: int
    _pend_lo: int
    _lps_n: int
    _policy_count: int
    execution_id: str
    _ids: np.ndarray
    _lps: np.ndarray
    calls: dict[str, Any]
    order: list[str]
    _seg_lo: list[int]
    _seg_hi: list[int]
    _seg_groups: list[tuple[Any, Any, Any, Any, np.ndarray, int]]
    stats: Any


_ext: Any = None
_arena: Any = None
if os.environ.get(ENV, "1") != "0":
    try:
        from gyre_traj import _ingest as _ext
    except ImportError:  # not built (no C compiler where gyre-traj was installed)
        _ext = None
    try:
        from gyre_traj import _arena
    except ImportError:  # not built (no C compiler, or not a POSIX system)
        _arena = None

BUILT: bool = _ext is not None
"""Whether the extension is built and imported."""

if TYPE_CHECKING:
    TreeState = PyTreeState
else:
    TreeState = _ext.TreeState if BUILT else PyTreeState

ExtendNext = Callable[[Any, dict[str, Any]], Any]
extend_next: ExtendNext | None = _ext.extend_next if BUILT else None
"""`extend_next(data, trees)`: the native path (None when it is not in use). Returns the CallInfo of
the call it placed, or None (nothing changed) for a message it leaves to the Python path."""


ARENA: type | None = getattr(_arena, "Arena", None)
"""`gyre_traj._arena.Arena` when that extension is built and imported, else None."""
arena_type: type | None = ARENA
"""`Arena(nbytes)`, where `ExecutionTree._reserve` moves a tree's ids past its first array (None when it
is not in use: numpy arrays instead)."""


def in_use() -> bool:
    """Whether `Forest.ingest_frame` tries the native path first."""
    return extend_next is not None


@contextmanager
def use_native(enabled: bool) -> Iterator[None]:
    """Inside this block the native path is used (when built) or not; as it was after it."""
    global extend_next, arena_type
    before = extend_next, arena_type
    extend_next = _ext.extend_next if enabled and BUILT else None
    arena_type = ARENA if enabled else None
    try:
        yield
    finally:
        extend_next, arena_type = before


def setup(
    call_info: type,
    roles: dict[str, Any],
    schema_version: int,
    max_weight_version: int,
    no_pending: int,
    root: int,
) -> None:
    """Hand the extension what it builds and checks against (gyre_traj.tree calls it once)."""
    if BUILT:
        _ext.setup(call_info, roles, schema_version, max_weight_version, no_pending, root)
