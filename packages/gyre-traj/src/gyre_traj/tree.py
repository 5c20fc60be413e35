"""The trajectory tree of one execution: every call's input+output merged on shared token prefixes.

Tokens live once in an append-only arena of ids. A run is a stretch of the arena appended together:
inside it each token's parent is the one before it, so matching a new call against the tree is a few
bulk comparisons (libc memcmp where available), not a loop over tokens, and a token's parent and depth
follow from its run's first node. Branch points keep their extra children in a dict. Policy tokens are
kept as segments (an output appended in one piece, with a reference to its logprobs) plus promotions;
the per-token arrays (`parent`, `depth`, `policy`, `logprob`, `version`) are derived on first use and
cached. A token the policy produced stays a policy token whatever later calls carry it as; a later
call whose context contradicts a policy token is recorded as a `Drift` and becomes its own branch (its
output is still trained in the context it saw).
"""

from __future__ import annotations

import bisect
import ctypes
import operator
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

import msgspec
import numpy as np

from gyre_traj import native
from gyre_traj.io import (
    EXT_F32,
    EXT_IDS,
    CallView,
    call_view_decoder,
    decode_msgpack_record,
    iter_msgpack,
)
from gyre_traj.records import (
    ID_DTYPE,
    LOGPROB_DTYPE,
    MAX_WEIGHT_VERSION,
    SCHEMA_VERSION,
    Call,
    CallBatch,
    RecordError,
    Role,
    Score,
    _where,
    check_logprobs,
    defer_input_sign_check,
)

ROOT = -1


class CallInfo(msgspec.Struct, frozen=True, gc=False):
    """Where a call sits in the tree: `end` is the arena index of its last token (ROOT if empty)."""

    call_id: str
    agent_id: str
    role: Role
    end: int
    n_input: int
    n_output: int
    weight_version: int
    finish_reason: str
    t_start: float
    t_end: float

    @property
    def length(self) -> int:
        return self.n_input + self.n_output


@dataclass(frozen=True, slots=True)
class Drift:
    """A call's context disagreed with tokens the policy had produced at that position. Recorded once,
    by the call that first diverged there; later calls that carry the same context follow its branch."""

    call_id: str
    position: int  # index in the call's input where it diverged
    expected: tuple[int, ...]  # the policy token(s) already in the tree there
    got: int  # the context token the call carried instead


@dataclass(slots=True)
class IngestStats:
    calls: int = 0
    call_tokens: int = 0  # sum of every call's input+output length (what storing calls apart costs)
    delta_calls: int = 0
    output_matched_existing: int = 0  # output tokens that were already in the tree as policy tokens
    context_promoted: int = 0  # tokens first seen as context, later produced by the policy
    drifts: list[Drift] = field(default_factory=list)


def _load_memcmp() -> Callable[[int, int, int], int] | None:
    """libc's memcmp through ctypes (one call compares megabytes at memory speed), or None."""
    try:
        lib = ctypes.cdll.msvcrt if sys.platform == "win32" else ctypes.CDLL(None)
        fn = lib.memcmp
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        a, b = np.arange(4, dtype=ID_DTYPE), np.array([0, 1, 2, 5], ID_DTYPE)
        if fn(a.ctypes.data, b.ctypes.data, 12) != 0 or fn(a.ctypes.data, b.ctypes.data, 16) == 0:
            return None
        return cast(Callable[[int, int, int], int], fn)
    except (OSError, AttributeError):
        return None


_MEMCMP = _load_memcmp()
_MEMCMP_MIN = 1 << 14  # below this many tokens numpy's comparison is faster than the ctypes call
_CHUNK = 1 << 18  # tokens compared per step: a long match costs one pass, an early mismatch exits early
_COPY_CHUNK = 1 << 16  # tokens copied then checked per step: the check reads them back from cache
NO_NODE = ROOT - 1
_NO_PENDING = 1 << 62
_umax = np.maximum.reduce
_fmax = np.maximum.reduce
_imin = np.minimum.reduce  # (`ndarray.min` without its Python wrapper)
_Ext = msgspec.msgpack.Ext
_CODES = (EXT_IDS, EXT_IDS, EXT_F32)  # the extension types of a call's input ids, output ids, logprobs
# What the native path (`native.extend_next`) builds and checks against.
native.setup(CallInfo, {r.value: r for r in Role}, SCHEMA_VERSION, MAX_WEIGHT_VERSION, _NO_PENDING, ROOT)


def _view_fields_ok(view: CallView) -> bool:
    """The checks `Call` makes of a record's scalar fields, on a `CallView`: non-empty execution and call
    ids, a schema version this reader knows, a weight version in int32's range, timestamps not NaN."""
    return (
        bool(view.execution_id)
        and bool(view.call_id)
        and view.v <= SCHEMA_VERSION
        and 0 <= view.weight_version <= MAX_WEIGHT_VERSION
        and view.t_start == view.t_start
        and view.t_end == view.t_end
    )


def _view_array(x: Any, code: int, dtype: np.dtype[Any]) -> np.ndarray | None:
    """A `CallView` array as a numpy view into its message when it came as extension type `code`
    holding whole 4-byte items, else None."""
    if type(x) is not _Ext or x.code != code:
        return None
    data = cast(memoryview, x.data)  # (what `call_view_decoder` gives: a view into the message)
    if len(data) & 3:
        return None
    return np.frombuffer(data, dtype)


def _first_mismatch(a: np.ndarray, b: np.ndarray) -> int:
    """Index of the first position where a and b (equal length, same dtype) differ, or their length."""
    n = a.shape[0]
    if _MEMCMP is not None and n >= _MEMCMP_MIN and a.flags.c_contiguous and b.flags.c_contiguous:
        pa, pb, size = a.ctypes.data, b.ctypes.data, a.itemsize
        for lo in range(0, n, _CHUNK):
            k = min(_CHUNK, n - lo)
            if _MEMCMP(pa + lo * size, pb + lo * size, k * size):
                return lo + int(np.argmax(a[lo : lo + k] != b[lo : lo + k]))
        return n
    for lo in range(0, n, _CHUNK):
        hi = min(n, lo + _CHUNK)
        ne = a[lo:hi] != b[lo:hi]
        k = int(ne.argmax())
        if ne[k]:
            return lo + k
    return n


class _Undo(NamedTuple):
    """What `ExecutionTree._rollback` needs to undo a batch: the lengths of the append-only state."""

    n: int
    runs: int
    segments: int
    groups: int
    promos: int
    calls: int
    policy: int
    counts: tuple[int, int, int, int, int]
    drifts: int


@dataclass(slots=True)
class _Stretch:
    """Inside `ExecutionTree.add_batch`: the calls placed since the last compared call start at batch
    index `w0`, and their tokens sit in the arena at batch token index + `delta`."""

    w0: int
    delta: int


@dataclass(frozen=True, slots=True)
class _BatchPlan:
    """Step 1 of `ExecutionTree.add_batch`: a batch's columns as the placing loop reads them, which calls
    are chained to the one before them (placed with it, never visited), and which must be visited."""

    batch: CallBatch
    m: int
    toks: np.ndarray
    toks_u: np.ndarray
    """The tokens as unsigned ints: a negative id is a maximum >= 2**31."""
    lps_all: np.ndarray
    """The batch's logprobs, owned (one copy for the whole batch)."""
    lp_arr: np.ndarray
    keep_arr: np.ndarray
    lengths: np.ndarray
    """Each call's input + output length."""
    seg_lo: np.ndarray
    seg_hi: np.ndarray
    """Each call's output relative to the batch: its policy segment once placed (empty without output)."""
    call_ids: list[str]
    parents: list[str]
    agents: list[str]
    roles: list[Role]
    fins: list[str]
    tok_off: list[int]
    inputs_l: list[int]
    n_out_l: list[int]
    vers_l: list[int]
    t0_l: list[float]
    t1_l: list[float]
    dup: set[str]
    """Call ids already in the tree: compared, and rejected there."""
    visit: list[int]
    """The calls the loop visits (ascending), then m."""
    index: dict[str, int]
    """Batch index of each call the next visited call follows: the only placed calls that can still be
    extended without comparison (nothing follows them in the arena yet)."""

    @classmethod
    def of(cls, batch: CallBatch, calls: dict[str, CallInfo]) -> _BatchPlan:
        m = len(batch)
        toks = batch.tokens
        tok_arr, lp_arr = batch.offsets()
        keep_arr, n_out_arr = batch.keeps, batch.output_lens
        inputs = keep_arr + batch.input_lens  # each call's input length
        lengths = inputs + n_out_arr
        call_ids, parents = batch.call_ids, batch.parents
        dup = set() if calls.keys().isdisjoint(call_ids) else calls.keys() & set(call_ids)
        # Chains: call k extends the whole of call k-1 and carries tokens. Placed right after call k-1,
        # it continues call k-1's run, which ends at the arena's last token: nothing to look up. Only
        # the other calls (and a call right after a compared one) are visited.
        chain = np.zeros(m, np.bool_)
        if m > 1:
            np.equal(keep_arr[1:], lengths[:-1], out=chain[1:])
            chain[1:] &= lengths[1:] > keep_arr[1:]  # it carries tokens
            chain[1:] &= np.fromiter(map(operator.eq, parents[1:], call_ids[:-1]), np.bool_, m - 1)
        if dup:  # a call id already in the tree is compared (and rejected there)
            chain[[k for k, cid in enumerate(call_ids) if cid in dup]] = False
        visit = np.flatnonzero(~chain).tolist()
        visit.append(m)
        seg_hi = tok_arr[1:]
        return cls(
            batch=batch,
            m=m,
            toks=toks,
            toks_u=toks.view(np.uint32),
            lps_all=np.array(batch.logprobs, LOGPROB_DTYPE),
            lp_arr=lp_arr,
            keep_arr=keep_arr,
            lengths=lengths,
            seg_lo=seg_hi - n_out_arr,
            seg_hi=seg_hi,
            call_ids=call_ids,
            parents=parents,
            agents=batch.agent_ids,
            roles=batch.roles,
            fins=batch.finish_reasons,
            tok_off=tok_arr.tolist(),
            inputs_l=inputs.tolist(),
            n_out_l=n_out_arr.tolist(),
            vers_l=batch.weight_versions.tolist(),
            t0_l=batch.t_start.tolist(),
            t1_l=batch.t_end.tolist(),
            dup=dup,
            visit=visit,
            index={call_ids[v - 1]: v - 1 for v in visit if v},
        )


class ExecutionTree(native.TreeState):
    """Prefix tree of one execution's calls. Add calls in an order where delta parents come first.

    Stored per token: the id and the policy flag. Stored per run (a stretch appended together, inside
    which each token's parent is the one before it): first node, parent, depth. Parent and depth per
    token, and logprob and weight version per token (kept as references to the records' output arrays
    until then), are derived on first use and cached until the tree changes.

    Its base class (`gyre_traj.native.TreeState`) holds the fields a placed call writes (`n`, the
    arena `_ids`, the logprob array `_lps` and `_lps_n`, the policy segments, `_policy_count`,
    `_pend_lo`, `calls`, `order`, `stats`): a C struct when the native path is built, whose
    `extend_next` then writes them directly. For the rest it calls back five methods of this class:
    `_reserve` and `_grow_lps` to grow the two arrays, `has_children` and `_new_run` for a call whose
    parent ends inside the arena or that branches, `_note_drift` for a call that diverges; and it reads
    the run tables (`_starts`, `_rdep`, `_rpar`, `_start_set`, `_branches`) to follow a call down the
    tree as `_descend` does. They read and write as ordinary attributes either way."""

    def __init__(self, execution_id: str, capacity: int = 1 << 12) -> None:
        self.execution_id = execution_id
        self.n = 0
        self._ids = np.empty(capacity, ID_DTYPE)
        self._ids_b = memoryview(self._ids).cast("B")  # a message's ids are copied in by memcpy
        self._arena: Any = None  # the arena (`native.ARENA`) under `_ids` once it outgrew `capacity`
        # The logprobs of the calls `extend_next` took, appended to one array; when it is full, a fresh
        # one twice its size takes over (a segment refers to the array it was written into).
        self._lps = np.empty(0, LOGPROB_DTYPE)
        self._lps_b = memoryview(self._lps).cast("B")
        self._lps_n = 0
        self._starts: list[int] = []  # first node of each run, ascending
        self._start_set: set[int] = set()
        self._rpar: list[int] = []  # parent of each run's first node
        self._rdep: list[int] = []  # depth of each run's first node
        self._branches: dict[int, dict[int, int]] = {}  # node -> {first token: first node} of runs below it
        # Policy tokens: each appended output is a segment of nodes [lo, hi) with its logprobs
        # (array[a:b]) and version, appended in arena order; context tokens the policy later produced
        # are promotions (nodes, logprobs, version). Nothing else is policy.
        self._seg_lo: list[int] = []
        self._seg_hi: list[int] = []
        # Segments are added alone or in groups: (first node(s), end(s), logprob offset(s), version(s),
        # logprob array, shift), ints for one segment, arrays for a group (nodes: first/end + shift).
        self._seg_groups: list[tuple[Any, Any, Any, Any, np.ndarray, int]] = []
        self._promos: list[tuple[np.ndarray, np.ndarray, int]] = []
        self._promoted: set[int] = set()
        self._policy_count = 0
        # Inside `add_batch`: stretches of placed calls not copied into the arena yet, in arena order,
        # as (first node, end node, source ids, offset) with node x at source[x - offset]; all are
        # copied (and checked) at the end of the batch. `_pend_lo` is the first such node.
        self._pending: list[tuple[int, int, np.ndarray, int]] = []
        self._pend_lo = _NO_PENDING
        self._derived: dict[str, np.ndarray] = {}
        self._derived_key: tuple[int, int, int] = (-1, -1, -1)
        self.calls: dict[str, CallInfo] = {}
        self._ends: set[int] = set()  # where the first `_ends_seen` calls of `order` end (`_call_ends`)
        self._ends_seen = 0
        self.order: list[str] = []
        self.stats = IngestStats()
        self.score: Score | None = None

    # ------------------------------------------------------------------------------------- storage

    def _reserve(self, extra: int) -> None:
        need = self.n + extra
        cap = self._ids.shape[0]
        if need <= cap:
            return
        self._ids_b.release()  # (an exported buffer is a reference: numpy's resize would refuse)
        if not self._grow_in_arena(need):
            new_cap = max(need, cap * 4)
            # Grow 4x: fresh pages are only touched when written, so the unused tail costs address
            # space, not memory. In place when nothing else refers to the arena (numpy's resize, a
            # realloc, which the allocator mostly does without copying what is stored); else into a new
            # array, copied.
            if not self._resize_arena(new_cap):
                ids = np.empty(new_cap, ID_DTYPE)
                ids[: self.n] = self._ids[: self.n]
                self._ids = ids
        self._ids_b = memoryview(self._ids).cast("B")

    def _grow_in_arena(self, need: int) -> bool:
        """Room for `need` ids in an `Arena`, or False (numpy arrays from here on). Past its first array
        the tree moves into one (once: copying at most that array), which then grows in place: nothing
        stored is copied again, and the pages it writes are mostly ones an earlier tree left mapped.
        False when arenas are not in use, when no address space can be reserved, or past an arena's
        reserved range (the tree then moves to a numpy array, copied once)."""
        nbytes = (need + max(need >> 2, 1 << 18)) * ID_DTYPE.itemsize  # a quarter more, >= 1 MiB more
        arena = self._arena
        if arena is not None:
            if arena.grow(nbytes):
                self._ids = np.frombuffer(arena, ID_DTYPE)
                return True
            self._arena = None
            return False
        arena_type = native.arena_type
        if arena_type is None:
            return False
        try:
            arena = arena_type(nbytes)
        except (OSError, ValueError):
            return False
        ids = np.frombuffer(arena, ID_DTYPE)
        ids[: self.n] = self._ids[: self.n]
        self._arena, self._ids = arena, ids
        return True

    def _resize_arena(self, cap: int) -> bool:
        """Resize the arena to `cap` ids keeping its contents, or False when something else refers to
        it (a view a caller holds: it must stay valid). Its writeable flag is off meanwhile, so that
        numpy does not zero the new tail (every id there is written before it is read)."""
        self._ids.flags.writeable = False
        try:
            self._ids.resize(cap, refcheck=True)
        except ValueError:
            return False
        finally:
            self._ids.flags.writeable = True
        return True

    def _depth_of(self, node: int) -> int:
        r = bisect.bisect_right(self._starts, node) - 1
        return self._rdep[r] + node - self._starts[r]

    def _new_run(self, after: int, lo: int, first_token: int) -> None:
        self._starts.append(lo)
        self._start_set.add(lo)
        self._rpar.append(after)
        self._rdep.append(0 if after == ROOT else self._depth_of(after) + 1)
        if after != ROOT or lo > 0:
            self._branches.setdefault(after, {})[first_token] = lo

    def _append(
        self, after: int, tokens: np.ndarray, policy: bool, logprobs: np.ndarray | None, version: int
    ) -> int:
        """Append `tokens` as a chain below node `after`; returns the last new node."""
        k = tokens.shape[0]
        if k == 0:
            return after
        self._reserve(k)
        lo, hi = self.n, self.n + k
        if after != lo - 1 or after == ROOT:
            # A new run (a branch, or the first tokens of the tree). Extending the arena's last token
            # in place needs no bookkeeping: it just continues the last run.
            self._new_run(after, lo, int(tokens[0]))
        self._ids[lo:hi] = tokens
        if policy:
            assert logprobs is not None
            self._add_segment(lo, hi, logprobs, 0, version)
        self.n = hi
        return hi - 1

    def _add_segment(self, lo: int, hi: int, arr: np.ndarray, a: int, version: int) -> None:
        self._seg_lo.append(lo)
        self._seg_hi.append(hi)
        self._seg_groups.append((lo, hi, a, version, arr, 0))
        self._policy_count += hi - lo

    def _is_policy(self, node: int) -> bool:
        r = bisect.bisect_right(self._seg_lo, node) - 1
        return (r >= 0 and node < self._seg_hi[r]) or node in self._promoted

    def _policy_range(self, lo: int, hi: int) -> np.ndarray:
        """The policy flags of nodes [lo, hi)."""
        out = np.zeros(hi - lo, np.bool_)
        seg_lo, seg_hi = self._seg_lo, self._seg_hi
        r = max(0, bisect.bisect_right(seg_lo, lo) - 1)
        while r < len(seg_lo) and seg_lo[r] < hi:
            a, b = max(lo, seg_lo[r]), min(hi, seg_hi[r])
            if a < b:
                out[a - lo : b - lo] = True
            r += 1
        if self._promoted:
            for nodes, _, _ in self._promos:
                inside = nodes[(nodes >= lo) & (nodes < hi)]
                out[inside - lo] = True
        return out

    @staticmethod
    def _placed_policy(x: int, tok_off: list[int], n_out: list[int]) -> bool:
        """Whether token x of a batch (tokens at `tok_off`, outputs `n_out` long) is an output token."""
        j = bisect.bisect_right(tok_off, x) - 1
        return x >= tok_off[j + 1] - n_out[j]

    def _call_ends(self) -> set[int]:
        """The nodes some call ends at: kept by `add` one call at a time, brought up to date on use
        (`_note_drift`) after a batch, which does not maintain it per call."""
        if self._ends_seen < len(self.order):
            calls = self.calls
            self._ends.update([calls[cid].end for cid in self.order[self._ends_seen :]])
            self._ends_seen = len(self.order)
        return self._ends

    def _run_end(self, node: int) -> int:
        r = bisect.bisect_right(self._starts, node)
        return self._starts[r] if r < len(self._starts) else self.n

    def _derive(self) -> dict[str, np.ndarray]:
        key = (self.n, len(self._seg_groups), len(self._promos))
        if key == self._derived_key:
            return self._derived
        n = self.n
        starts = np.asarray(self._starts, np.int64)
        lengths = np.diff(np.append(starts, n))
        idx = np.arange(n, dtype=np.int32)
        parent = idx - 1
        parent[starts] = np.asarray(self._rpar, np.int32)
        depth = idx + np.repeat((np.asarray(self._rdep, np.int64) - starts).astype(np.int32), lengths)
        policy = np.zeros(n, np.bool_)
        logprob = np.zeros(n, LOGPROB_DTYPE)
        version = np.full(n, -1, np.int32)
        for lo, hi, src, vers, lps, shift in self._seg_groups:
            if isinstance(lo, int):
                policy[lo:hi] = True
                logprob[lo:hi] = lps[src : src + hi - lo]
                version[lo:hi] = vers
                continue
            lens = (hi - lo).astype(np.int64)
            total = int(lens.sum())
            before = np.cumsum(lens) - lens  # position of each segment inside the group
            step = np.arange(total, dtype=np.int64)
            pos = np.repeat(lo + (shift - before), lens) + step
            policy[pos] = True
            logprob[pos] = lps[np.repeat(src - before, lens) + step]
            version[pos] = np.repeat(vers, lens)
        for nodes, lps, v in self._promos:
            policy[nodes] = True
            logprob[nodes] = lps
            version[nodes] = v
        self._derived = {
            "parent": parent,
            "depth": depth,
            "policy": policy,
            "logprob": logprob,
            "version": version,
        }
        self._derived_key = key
        return self._derived

    @property
    def ids(self) -> np.ndarray:
        """Token id of each node (arena order)."""
        return self._ids[: self.n]

    @property
    def policy(self) -> np.ndarray:
        """Whether the policy produced each node. Derived, cached."""
        return self._derive()["policy"]

    @property
    def parent(self) -> np.ndarray:
        """Parent node of each node (ROOT for the first token of a root run). Derived, cached."""
        return self._derive()["parent"]

    @property
    def depth(self) -> np.ndarray:
        """Position of each node on its root-to-node path (0 for the first token). Derived, cached."""
        return self._derive()["depth"]

    @property
    def logprob(self) -> np.ndarray:
        """Behaviour logprob of each policy node (0 for context). Derived, cached."""
        return self._derive()["logprob"]

    @property
    def version(self) -> np.ndarray:
        """Weight version that produced each policy node (-1 for context). Derived, cached."""
        return self._derive()["version"]

    def has_children(self, node: int) -> bool:
        if node == ROOT:
            return self.n > 0
        c = node + 1
        return (c < self.n and c not in self._start_set) or node in self._branches

    def children(self, node: int) -> list[int]:
        out = []
        if node == ROOT:
            if self.n > 0:
                out.append(0)
        elif node + 1 < self.n and node + 1 not in self._start_set:
            out.append(node + 1)
        out.extend(v for v in self._branches.get(node, {}).values() if v not in out)
        return out

    def _token(self, node: int) -> int:
        """The id at `node` (inside `add_batch`, possibly still in the batch, not yet copied)."""
        if node < self._pend_lo:
            return int(self._ids[node])
        return int(self._span(node, 1)[0])

    def _span(self, lo: int, k: int) -> np.ndarray:
        """The ids of nodes [lo, lo + k): a view of the arena, or of the batch while pending there."""
        hi = lo + k
        if hi <= self._pend_lo:
            return self._ids[lo:hi]
        pieces, pos = [], lo
        for a, b, src, d in self._pending:
            if b <= pos:
                continue
            if a >= hi:
                break
            if pos < a:
                pieces.append(self._ids[pos:a])
                pos = a
            e = min(b, hi)
            pieces.append(src[pos - d : e - d])
            pos = e
        if pos < hi:
            pieces.append(self._ids[pos:hi])
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def _child(self, node: int, tok: int) -> int:
        if node == ROOT:
            if self.n > 0 and (int(self._ids[0]) if self._pend_lo > 0 else self._token(0)) == tok:
                return 0
        else:
            c = node + 1
            if (
                c < self.n
                and c not in self._start_set
                and (int(self._ids[c]) if c < self._pend_lo else self._token(c)) == tok
            ):
                return c
        b = self._branches.get(node)
        return b.get(tok, NO_NODE) if b is not None else NO_NODE

    def _descend(self, node: int, seq: np.ndarray, i: int) -> tuple[int, int]:
        """Follow seq[i:] down from `node` while the tree agrees; returns (last matched node, next i)."""
        n_seq = seq.shape[0]
        while i < n_seq:
            nxt = self._child(node, int(seq[i]))
            if nxt == NO_NODE:
                return node, i
            span = min(self._run_end(nxt) - nxt, n_seq - i)
            tree = self._ids[nxt : nxt + span] if nxt + span <= self._pend_lo else self._span(nxt, span)
            m = _first_mismatch(tree, seq[i : i + span])
            node, i = nxt + m - 1, i + m
        return node, i

    def path_slices(self, end: int, from_depth: int = 0) -> list[tuple[int, int]]:
        """Arena slices [lo, hi) covering the root-to-`end` path from depth `from_depth`, root first."""
        out: list[tuple[int, int]] = []
        starts, rdep, rpar = self._starts, self._rdep, self._rpar
        node = end
        while node != ROOT:
            r = bisect.bisect_right(starts, node) - 1
            start, d_start = starts[r], rdep[r]
            if d_start <= from_depth:
                lo = start + (from_depth - d_start)
                if lo <= node:
                    out.append((lo, node + 1))
                break
            out.append((start, node + 1))
            node = rpar[r]
        out.reverse()
        return out

    def node_at_depth(self, end: int, depth: int) -> int:
        """The ancestor of `end` at `depth` (ROOT for depth -1)."""
        if depth < 0:
            return ROOT
        starts, rdep, rpar = self._starts, self._rdep, self._rpar
        node = end
        while node != ROOT:
            r = bisect.bisect_right(starts, node) - 1
            if rdep[r] <= depth:
                return starts[r] + (depth - rdep[r])
            node = rpar[r]
        raise IndexError(f"depth {depth} is below the root of node {end}")

    def path_nodes(self, end: int) -> np.ndarray:
        """Arena indices of the root-to-`end` path."""
        sl = self.path_slices(end)
        if not sl:
            return np.zeros(0, np.int64)
        return np.concatenate([np.arange(lo, hi) for lo, hi in sl])

    def sequence(self, end: int) -> np.ndarray:
        sl = self.path_slices(end)
        if not sl:
            return np.zeros(0, ID_DTYPE)
        return np.concatenate([self._ids[lo:hi] for lo, hi in sl])

    # --------------------------------------------------------------------------------------- ingest

    def add(self, call: Call) -> CallInfo:
        """Merge one call. Raises RecordError naming the call if it is inconsistent with the tree."""
        if call.execution_id != self.execution_id:
            raise RecordError(
                f"{call.where}: belongs to execution {call.execution_id!r}, not {self.execution_id!r}"
            )
        # Owned (the caller may reuse its array), and checked here: a call decoded inside
        # `defer_input_sign_check` comes unchecked, and the copy is aligned and in cache.
        lps = np.array(call.output_logprobs, LOGPROB_DTYPE)
        try:
            check_logprobs(lps)
        except ValueError as exc:
            raise RecordError(f"{call.where}: {exc}") from None
        d = call.input_delta
        if d is None:
            assert call.input_ids is not None
            parent, keep, rest = None, 0, call.input_ids
        else:
            parent, keep, rest = d.parent, d.keep, d.append
            par = self.calls.get(parent)
            if (
                par is not None
                and keep == par.length
                and par.end == self.n - 1 >= 0
                and self._pend_lo == _NO_PENDING
                and call.call_id not in self.calls
            ):
                # The agent's next call: it extends the whole of its parent, which ends at the arena's
                # last token (nothing hangs below it), so every token it carries is new.
                return self._extend_last(call, keep, rest, lps)
        return self._add(
            call.call_id,
            call.agent_id,
            call.role,
            call.weight_version,
            call.finish_reason,
            call.t_start,
            call.t_end,
            parent,
            keep,
            rest,
            call.output_ids,
            lps,
            check_output=True,
        )

    def _add(
        self,
        call_id: str,
        agent_id: str,
        role: Role,
        weight_version: int,
        finish_reason: str,
        t_start: float,
        t_end: float,
        parent: str | None,
        keep: int,
        rest: np.ndarray,
        out: np.ndarray,
        lps: np.ndarray,
        check_output: bool = False,
    ) -> CallInfo:
        if call_id in self.calls:
            raise RecordError(f"{_where(self.execution_id, call_id)}: duplicate call id in this execution")
        st = self.stats
        cut_parent: CallInfo | None = None
        if parent is not None:
            cut_parent = self.calls.get(parent)
            if cut_parent is None:
                raise RecordError(
                    f"{_where(self.execution_id, call_id)}: input_delta names unknown parent call {parent!r} "
                    f"(parents must come before the calls that extend them)"
                )
            if keep > cut_parent.length:
                raise RecordError(
                    f"{_where(self.execution_id, call_id)}: input_delta.keep={keep} exceeds parent "
                    f"{parent!r} length {cut_parent.length}"
                )
            start = self.node_at_depth(cut_parent.end, keep - 1)
            st.delta_calls += 1
        else:
            start, keep = ROOT, 0
        n_in = keep + rest.shape[0]
        node, i = self._descend(start, rest, 0)
        if i < rest.shape[0]:
            if _imin(rest[i:]) < 0:  # the part matched against the tree is known non-negative
                pos = i + int(np.flatnonzero(rest[i:] < 0)[0])
                raise RecordError(
                    f"{_where(self.execution_id, call_id)}: input ids contain a negative id {int(rest[pos])} "
                    f"at position {keep + pos}"
                )
            self._note_drift(call_id, node, int(rest[i]), keep + i, cut_parent)
            node = self._append(node, rest[i:], False, None, -1)
        in_end = node
        node, j = self._descend(in_end, out, 0)
        if j > 0:
            self._promote(in_end, node, lps, weight_version, j)
        if j < out.shape[0]:
            if check_output and _imin(out[j:]) < 0:
                pos = j + int(np.flatnonzero(out[j:] < 0)[0])
                raise RecordError(
                    f"{_where(self.execution_id, call_id)}: output ids contain a negative id {int(out[pos])} "
                    f"at position {pos}"
                )
            node = self._append(node, out[j:], True, lps[j:], weight_version)
        info = CallInfo(
            call_id, agent_id, role, node, n_in, out.shape[0], weight_version, finish_reason, t_start, t_end
        )
        self.calls[call_id] = info
        self.order.append(call_id)
        if self._ends_seen == len(self.order) - 1:  # the set is up to date: keep it so (cheap here)
            self._ends.add(node)
            self._ends_seen += 1
        st.calls += 1
        st.call_tokens += info.length
        return info

    def _extend_last(self, call: Call, keep: int, rest: np.ndarray, lps: np.ndarray) -> CallInfo:
        """`_add` of a call all of whose tokens continue the arena's last run (input, then output): one
        copy of each into the arena, one sign check of both where they landed, and nothing compared,
        looked up or re-read; the work is proportional to the tokens it carries. A negative id leaves
        the tree as it was (nothing is counted until the check passed)."""
        out = call.output_ids
        k_in, k_out = rest.shape[0], out.shape[0]
        lo = self.n
        mid, hi = lo + k_in, lo + k_in + k_out
        self._reserve(k_in + k_out)
        ids = self._ids
        ids[lo:mid] = rest
        ids[mid:hi] = out
        if hi > lo and _umax(ids[lo:hi].view(np.uint32)) >= 1 << 31:
            where = call.where
            if k_in and int(rest.min()) < 0:
                pos = int(np.flatnonzero(rest < 0)[0])
                raise RecordError(
                    f"{where}: input ids contain a negative id {int(rest[pos])} at position {keep + pos}"
                )
            pos = int(np.flatnonzero(out < 0)[0])
            raise RecordError(f"{where}: output ids contain a negative id {int(out[pos])} at position {pos}")
        version, cid = call.weight_version, call.call_id
        if k_out:
            self._seg_lo.append(mid)
            self._seg_hi.append(hi)
            self._seg_groups.append((mid, hi, 0, version, lps, 0))
            self._policy_count += k_out
        self.n = hi
        info = CallInfo(
            cid,
            call.agent_id,
            call.role,
            hi - 1,
            keep + k_in,
            k_out,
            version,
            call.finish_reason,
            call.t_start,
            call.t_end,
        )
        self.calls[cid] = info
        self.order.append(cid)
        if self._ends_seen == len(self.order) - 1:
            self._ends.add(hi - 1)
            self._ends_seen += 1
        st = self.stats
        st.calls += 1
        st.call_tokens += keep + k_in + k_out
        st.delta_calls += 1
        return info

    def extend_next(self, view: CallView) -> CallInfo | None:
        """Add the call of `view` (a decoded message, its arrays still bytes in it) when it extends the
        whole of its delta parent, and nothing hangs below the parent's last token yet (an agent's next
        call: its every token is new), its arrays are raw int32 ids and float32 logprobs, and its fields
        are in range. Its ids are copied from the message into the arena and its logprobs into the
        tree's logprob array (one memcpy each), each checked once where it landed; nothing else is read,
        and the work is that copy plus a fixed cost whatever the context's length. Returns its CallInfo,
        or None (the tree unchanged) for anything else, a bad value included: `add_view`, or `add` of
        the decoded `Call`, then merges it or says what is wrong, as for any call. The native half of
        the live path (`gyre_traj.native.extend_next`) does the same from the message's bytes, and
        leaves to this method whatever it is not sure of."""
        d = view.input_delta
        if d is None or view.input_ids is not None or view.execution_id != self.execution_id:
            return None
        cid, keep = view.call_id, d.keep
        par = self.calls.get(d.parent)
        if (
            par is None
            or keep != par.n_input + par.n_output
            or cid in self.calls
            or self._pend_lo != _NO_PENDING
            # `_view_fields_ok`, inline (this runs once per message)
            or not cid
            or view.v > SCHEMA_VERSION
            or not 0 <= view.weight_version <= MAX_WEIGHT_VERSION
            or view.t_start != view.t_start  # NaN
            or view.t_end != view.t_end
        ):
            return None
        after, lo = par.end, self.n
        if after == ROOT or (after != lo - 1 and self.has_children(after)):
            return None  # a parent with no tokens, or one with something below its last token
        rest, out, lps = d.append, view.output_ids, view.output_logprobs
        try:
            if (rest.code, out.code, lps.code) != _CODES:
                return None
            rest_b, out_b, lps_b = rest.data, out.data, lps.data
        except AttributeError:  # not extension values (the only ones `CallView` gives with these names)
            return None
        n_rest, n_out = len(rest_b), len(out_b)  # in bytes
        if (n_rest | n_out) & 3 or len(lps_b) != n_out:
            return None  # not whole 4-byte items, or not one logprob per output id
        b0 = lo << 2
        b1 = b0 + n_rest
        b2 = b1 + n_out
        hi = b2 >> 2
        if hi > self._ids.shape[0]:
            self._reserve(hi - lo)
        ids_b = self._ids_b
        ids_b[b0:b1] = rest_b
        ids_b[b1:b2] = out_b
        if hi > lo:
            span = self._ids[lo:hi]
            if span[span.argmin()] < 0:
                return None  # a negative id (nothing is counted yet: the tree is as it was)
        mid = b1 >> 2
        k_out = hi - mid
        version = view.weight_version
        if k_out:
            a = self._lps_n
            b = a + k_out
            if b > self._lps.shape[0]:
                self._grow_lps(k_out)
                a, b = 0, k_out
            arr = self._lps
            self._lps_b[a << 2 : b << 2] = lps_b
            got = arr[a:b]
            if not got[got.argmax()] <= 1e-4:  # argmax gives the first NaN if any, which fails too
                return None
            self._lps_n = b
            self._seg_lo.append(mid)
            self._seg_hi.append(hi)
            self._seg_groups.append((mid, hi, a, version, arr, 0))
            self._policy_count += k_out
        end = hi - 1
        if after != lo - 1:
            # The parent ends inside the arena with nothing below it: the call starts a run there (or,
            # carrying no tokens, ends where its parent does).
            if hi > lo:
                self._new_run(after, lo, int(self._ids[lo]))
            else:
                end = after
        self.n = hi
        length = keep + hi - lo
        info = CallInfo(
            cid,
            view.agent_id,
            view.role,
            end,
            length - k_out,
            k_out,
            version,
            view.finish_reason,
            view.t_start,
            view.t_end,
        )
        self.calls[cid] = info
        self.order.append(cid)  # (`_call_ends` picks its end up when it is next asked)
        st = self.stats
        st.calls += 1
        st.call_tokens += length
        st.delta_calls += 1
        return info

    def add_view(self, view: CallView) -> CallInfo | None:
        """Add the call of `view` without building a `Call`: an agent's next call through `extend_next`,
        any other through `merge_view`. None (the tree unchanged) when neither takes it."""
        return self.extend_next(view) or self.merge_view(view)

    def merge_view(self, view: CallView) -> CallInfo | None:
        """Add the call of `view` (any call but one `extend_next` takes: a full input, a retry, a call
        after a compaction) through the merge `add` uses, its arrays read as numpy views into the
        message, no `Call` built. Taken when the call is well formed (its arrays raw int32 ids and
        float32 logprobs, one logprob per output id and none above 0 or NaN, its fields as `Call`
        requires them), its delta parent is known, its `keep` within it and its call id new; None (the
        tree unchanged) otherwise, and the decoded `Call`'s `add` then says what is wrong. A negative id
        it meets while merging is refused as `add` refuses it (the same code)."""
        cid, d = view.call_id, view.input_delta
        if (
            view.execution_id != self.execution_id
            or cid in self.calls
            or self._pend_lo != _NO_PENDING
            or not _view_fields_ok(view)
        ):
            return None
        parent: str | None = None
        keep = 0
        if d is None:
            rest = _view_array(view.input_ids, EXT_IDS, ID_DTYPE)
        else:
            if view.input_ids is not None:
                return None
            parent, keep = d.parent, d.keep
            par = self.calls.get(parent)
            if par is None or not 0 <= keep <= par.n_input + par.n_output:
                return None
            if keep == par.n_input + par.n_output and par.end == self.n - 1 >= 0:
                return None  # `add` takes such a call as the agent's next: `extend_next` did not
            rest = _view_array(d.append, EXT_IDS, ID_DTYPE)
        out = _view_array(view.output_ids, EXT_IDS, ID_DTYPE)
        lps = _view_array(view.output_logprobs, EXT_F32, LOGPROB_DTYPE)
        if rest is None or out is None or lps is None or lps.shape[0] != out.shape[0]:
            return None
        lps = lps.copy()  # owned: the tree keeps it, the message is the caller's
        if lps.shape[0] and not _fmax(lps) <= 1e-4:
            return None
        return self._add(
            cid,
            view.agent_id,
            view.role,
            view.weight_version,
            view.finish_reason,
            view.t_start,
            view.t_end,
            parent,
            keep,
            rest,
            out,
            lps,
            check_output=True,
        )

    def _grow_lps(self, need: int) -> None:
        """A fresh logprob array for `extend_next` with room for at least `need` logprobs (twice the
        last one's size at least), written from its start. Nothing is copied: each segment refers to
        the array its logprobs were written into, which it keeps alive."""
        grown = np.empty(max(need, 2 * self._lps.shape[0], 1 << 12), LOGPROB_DTYPE)
        self._lps = grown
        self._lps_n = 0
        self._lps_b = memoryview(grown).cast("B")

    def add_batch(self, batch: CallBatch) -> None:
        """Merge a `CallBatch` (its calls in order), all or nothing: if any call is bad, the error names
        it and the tree is left as it was before the batch.

        A call that carries new tokens only (it extends the whole of its delta parent, whose last token
        has no children yet: an agent's next call; or it starts a new branch at the root, or the tree is
        empty) is placed without looking at its tokens. Most calls are the next call of the agent right
        before them (a chain); those are found for the whole batch at once from its columns and not
        visited one by one. Between two calls that must be compared against the tree (they take `add`'s
        path), placed calls sit in the arena exactly as in the batch, shifted by one offset: such a
        stretch gets its policy segments and CallInfos in bulk before the next compared call. Its tokens
        are copied into the arena at the end of the batch, all stretches in one pass, each piece checked
        for negative ids where it landed (a compared call in between reads the ones it needs from the
        batch: `_span`). A negative id in a placed call is reported before the error of any compared
        call after it, as if each stretch had been copied in turn.

        Three steps: plan (`_BatchPlan.of`: the batch's columns, its chains and the calls to visit),
        place (`_place_batch`: every call placed or compared, tokens left pending), commit
        (`_commit_pending`: the pending tokens copied and checked); any failure rolls the tree back."""
        if batch.execution_id != self.execution_id:
            raise RecordError(
                f"call batch of execution {batch.execution_id!r} given to the tree of {self.execution_id!r}"
            )
        if len(batch) == 0:
            return
        plan = _BatchPlan.of(batch, self.calls)
        undo = self._checkpoint()
        # One growth for the whole batch (bounded: a batch of full inputs mostly matches the tree).
        self._reserve(min(plan.toks.shape[0], 1 << 26))
        try:
            self._place_batch(plan)
            self._commit_pending(plan)
        except BaseException as exc:
            # A negative id in a placed call comes before the compared call that failed (or is the
            # failure): that is the error to report, as if each stretch had been checked in turn.
            toks_u = plan.toks_u
            negative = isinstance(exc, RecordError) and any(
                int(_umax(toks_u[lo - d : hi - d])) >= 1 << 31 for lo, hi, _, d in self._pending
            )
            self._pending.clear()
            self._pend_lo = _NO_PENDING
            self._rollback(undo)
            if negative:
                try:
                    batch.raise_negative()
                except RecordError as neg:
                    raise neg from None
            raise
        # Every call of the batch is in: the counters are the batch's totals (`_add` counted its own
        # calls along the way; they are part of these totals, so they are set, not added).
        st = self.stats
        st.calls = undo.counts[0] + plan.m
        st.call_tokens = undo.counts[1] + int(plan.lengths.sum())
        st.delta_calls = undo.counts[2] + plan.m - plan.parents.count("")

    def _place_batch(self, plan: _BatchPlan) -> None:
        """Step 2 of `add_batch`: visit the calls that are not chained to the one before them; each is
        placed (with the chain after it) when it carries only new tokens, placed as a retry's branch, or
        compared against the tree (`_add`). Placed tokens stay pending (`_commit_pending`)."""
        st = _Stretch(0, self.n)
        visit, tok_off, toks, m = plan.visit, plan.tok_off, plan.toks, plan.m
        k = visit[0]
        while k < m:
            start = self._start_of_new_tokens(plan, st, k)
            if start != NO_NODE:
                a = tok_off[k]
                n = a + st.delta  # where this call's tokens go
                if n == 0:
                    # The first tokens of an empty tree. Its first token is written now, ahead of
                    # its stretch, for the root-branch test of the calls after it.
                    self._ids[0] = toks[a]
                if start != n - 1 or start == ROOT:
                    self._new_run(start, n, int(toks[a]))
                k = visit[bisect.bisect_right(visit, k)]  # the chain after it is placed with it
                continue
            if not self._place_retry(plan, st, k):
                self._compare(plan, st, k)
            k += 1  # visited whatever it is: a chain needs its parent placed
        self._place_stretch(plan, st, m)

    def _start_of_new_tokens(self, plan: _BatchPlan, st: _Stretch, k: int) -> int:
        """Where call k's tokens start hanging when all of them are new to the tree, so it can be placed
        without a look at its tokens: below the end of its delta parent (nothing there yet), below a
        context node of its parent's input that no child there starts with its first token, at the
        root (a new root branch, or the first call of an empty tree). NO_NODE when it must be compared."""
        par_id, tok_off = plan.parents[k], plan.tok_off
        a = tok_off[k]
        if tok_off[k + 1] <= a or plan.call_ids[k] in plan.dup:
            return NO_NODE
        delta, toks, branches, start_set = st.delta, plan.toks, self._branches, self._start_set
        n = a + delta  # where this call's tokens go if it is placed
        if not par_id:
            if n <= 0:
                return ROOT  # the first tokens of an empty tree
            # A new branch at the root (a sub-agent's first call) is all new too.
            first = int(toks[a])
            if first != self._token(0) and first not in branches.get(ROOT, ()):
                return ROOT
            return NO_NODE
        par = self.calls.get(par_id)
        if par is not None:
            s, plen, pin = par.end, par.length, par.n_input
        else:  # a parent placed in this stretch is registered with it, later
            j = plan.index.get(par_id, plan.m)
            if not st.w0 <= j < k:
                return NO_NODE
            s, plen, pin = tok_off[j + 1] - 1 + delta, int(plan.lengths[j]), plan.inputs_l[j]
        keep = int(plan.keep_arr[k])
        if s == ROOT:
            return NO_NODE
        if keep == plen:
            if (s + 1 >= n or s + 1 in start_set) and s not in branches:
                return s
            return NO_NODE
        if 0 < keep < pin and tok_off[k + 1] - plan.n_out_l[k] > a:
            # It keeps part of its parent's input and appends to it: when its first appended token
            # starts no child of the node it continues, and that node is context (so no drift either),
            # it all is a new branch there.
            s = self.node_at_depth(s, keep - 1)
            first, c = int(toks[a]), s + 1
            here = tok_off[st.w0] + delta  # this stretch's first node (not in the arena yet)
            if (
                (c >= n or c in start_set or first != (int(toks[c - delta]) if c >= here else self._token(c)))
                and first not in branches.get(s, ())
                and not (
                    self._placed_policy(s - delta, tok_off, plan.n_out_l) if s >= here else self._is_policy(s)
                )
            ):
                return s
        return NO_NODE

    def _place_retry(self, plan: _BatchPlan, st: _Stretch, k: int) -> bool:
        """Place call k as a retry's branch when it is one: the call before it (placed) has the same delta
        parent, keep and appended input, so this input ends where that one's does; when its output starts
        with a token no child there has, the output is all new. False (nothing done) otherwise."""
        par_id, tok_off, n_out_l, toks = plan.parents[k], plan.tok_off, plan.n_out_l, plan.toks
        no = n_out_l[k]
        if not (
            par_id and st.w0 < k and no and plan.parents[k - 1] == par_id and plan.call_ids[k] not in plan.dup
        ):
            return False
        a, b = tok_off[k], tok_off[k + 1] - no  # where its input and its output start
        p, ni = k - 1, b - a
        p_out = tok_off[k] - n_out_l[p]  # where the output of call p starts in the batch
        in_end = p_out - 1 + st.delta
        first = int(toks[b])
        if not (
            ni
            and p_out - tok_off[p] == ni
            and n_out_l[p]
            and int(plan.keep_arr[k]) == int(plan.keep_arr[p])
            and first != int(toks[p_out])
            and first not in self._branches.get(in_end, ())
            and _first_mismatch(toks[a:b], toks[tok_off[p] : p_out]) == ni
        ):
            return False
        self._place_stretch(plan, st, k)
        lo = self.n
        self._new_run(in_end, lo, first)
        self._pending.append((lo, lo + no, toks, lo - b))
        self.n = hi = lo + no
        self._seg_lo.append(lo)
        self._seg_hi.append(hi)
        self._seg_groups.append((lo, hi, int(plan.lp_arr[k]), plan.vers_l[k], plan.lps_all, 0))
        self._policy_count += no
        cid = plan.call_ids[k]
        self.calls[cid] = CallInfo(
            cid,
            plan.agents[k],
            plan.roles[k],
            hi - 1,
            plan.inputs_l[k],
            no,
            plan.vers_l[k],
            plan.fins[k],
            plan.t0_l[k],
            plan.t1_l[k],
        )
        self.order.append(cid)
        st.w0, st.delta = k + 1, hi - tok_off[k + 1]
        return True

    def _compare(self, plan: _BatchPlan, st: _Stretch, k: int) -> None:
        """Place the stretch before call k, then merge call k as `add` does (compared with the tree)."""
        self._place_stretch(plan, st, k)
        tok_off, no = plan.tok_off, plan.n_out_l[k]
        a, b = tok_off[k], tok_off[k + 1] - no
        lp = int(plan.lp_arr[k])
        self._add(
            plan.call_ids[k],
            plan.agents[k],
            plan.roles[k],
            plan.vers_l[k],
            plan.fins[k],
            plan.t0_l[k],
            plan.t1_l[k],
            plan.parents[k] or None,
            int(plan.keep_arr[k]),
            plan.toks[a:b],
            plan.toks[b : b + no],
            plan.lps_all[lp : lp + no],
            check_output=True,
        )
        st.w0, st.delta = k + 1, self.n - tok_off[k + 1]

    def _place_stretch(self, plan: _BatchPlan, st: _Stretch, w1: int) -> None:
        """Place calls [st.w0, w1): their tokens (pending, copied at commit), segments and CallInfos."""
        w0, delta, tok_off = st.w0, st.delta, plan.tok_off
        if w1 == w0:
            return
        lo, hi = tok_off[w0] + delta, tok_off[w1] + delta
        self.n = lo
        self._reserve(hi - lo)
        if not self._pending:
            self._pend_lo = lo
        self._pending.append((lo, hi, plan.toks, delta))
        self.n = hi
        seg_lo, seg_hi, lp_arr = plan.seg_lo, plan.seg_hi, plan.lp_arr
        # A placed call ends where its tokens end, with its output.
        ends_l = (seg_hi[w0:w1] + (delta - 1)).tolist()
        self._seg_lo.extend((seg_lo[w0:w1] + delta).tolist())
        self._seg_hi.extend((seg_hi[w0:w1] + delta).tolist())
        self._seg_groups.append(
            (
                seg_lo[w0:w1],
                seg_hi[w0:w1],
                lp_arr[w0:w1],
                plan.batch.weight_versions[w0:w1],
                plan.lps_all,
                delta,
            )
        )
        self._policy_count += int(lp_arr[w1]) - int(lp_arr[w0])
        cids = plan.call_ids[w0:w1]
        infos = map(
            CallInfo,
            cids,
            plan.agents[w0:w1],
            plan.roles[w0:w1],
            ends_l,
            plan.inputs_l[w0:w1],
            plan.n_out_l[w0:w1],
            plan.vers_l[w0:w1],
            plan.fins[w0:w1],
            plan.t0_l[w0:w1],
            plan.t1_l[w0:w1],
        )
        self.order.extend(cids)
        self.calls.update(zip(cids, infos, strict=True))

    def _commit_pending(self, plan: _BatchPlan) -> None:
        """Step 3 of `add_batch`: the placed tokens, copied into the arena in one pass at the end (the
        Python work before runs with the batch's columns still in cache), each piece checked for negative
        ids where it landed: the arena is aligned and the piece still in cache (a decoded batch's tokens
        are a view into the stream, at any byte offset, where numpy's reductions are slower)."""
        ids = self._ids.view(np.uint32)  # unsigned: a negative id is a maximum >= 2**31
        toks_u = plan.toks_u
        for lo, hi, _, d in self._pending:
            for off in range(lo, hi, _COPY_CHUNK):
                dst = ids[off : min(hi, off + _COPY_CHUNK)]
                np.copyto(dst, toks_u[off - d : off - d + dst.shape[0]])
                if _umax(dst) >= 1 << 31:
                    plan.batch.raise_negative()
        self._pending.clear()
        self._pend_lo = _NO_PENDING

    def _checkpoint(self) -> _Undo:
        st = self.stats
        return _Undo(
            self.n,
            len(self._starts),
            len(self._seg_lo),
            len(self._seg_groups),
            len(self._promos),
            len(self.order),
            self._policy_count,
            (st.calls, st.call_tokens, st.delta_calls, st.output_matched_existing, st.context_promoted),
            len(st.drifts),
        )

    def _rollback(self, undo: _Undo) -> None:
        """Put the tree back as it was at `_checkpoint()` (everything added since is appended state)."""
        n = undo.n
        for lo in self._starts[undo.runs :]:
            self._start_set.discard(lo)
        del self._starts[undo.runs :], self._rpar[undo.runs :], self._rdep[undo.runs :]
        for node in list(self._branches):
            kids = {t: c for t, c in self._branches[node].items() if c < n}
            if kids:
                self._branches[node] = kids
            else:
                del self._branches[node]
        del self._seg_lo[undo.segments :], self._seg_hi[undo.segments :]
        del self._seg_groups[undo.groups :]
        for nodes, _, _ in self._promos[undo.promos :]:
            self._promoted.difference_update(nodes.tolist())
        del self._promos[undo.promos :]
        for cid in self.order[undo.calls :]:
            self.calls.pop(cid, None)
        del self.order[undo.calls :]
        self._ends, self._ends_seen = set(), 0
        self._policy_count = undo.policy
        st = self.stats
        st.calls, st.call_tokens, st.delta_calls, st.output_matched_existing, st.context_promoted = (
            undo.counts
        )
        del st.drifts[undo.drifts :]
        self.n = n

    def _note_drift(self, call_id: str, node: int, got: int, position: int, parent: CallInfo | None) -> None:
        """Divergence at `node`: drift when the context contradicts a policy output it continues, that is
        the cut falls inside the delta parent's output, or inside a policy span (the matched token and a
        policy child, and no call ends at the matched token). A divergence at an output's first token
        with no delta parent is a branch (a discarded retry looks the same), not drift."""
        pol = self._is_policy
        if (
            parent is not None
            and parent.n_input <= position < parent.length
            and self.node_at_depth(parent.end, position - 1) == node
        ):  # still on the parent's path
            theirs = self.node_at_depth(parent.end, position)
            if pol(theirs):
                self.stats.drifts.append(Drift(call_id, position, (self._token(theirs),), got))
                return
        if node == ROOT or not pol(node) or node in self._call_ends():
            return
        expected = tuple(self._token(c) for c in self.children(node) if pol(c))
        if expected:
            self.stats.drifts.append(Drift(call_id, position, expected, got))

    def _promote(self, in_end: int, node: int, lps: np.ndarray, version: int, j: int) -> None:
        """Output tokens out[:j] matched the existing path in_end -> node: context becomes policy."""
        d0 = 0 if in_end == ROOT else self._depth_of(in_end) + 1
        off = 0
        for lo, hi in self.path_slices(node, d0):
            pol = self._policy_range(lo, hi)
            self.stats.output_matched_existing += int(pol.sum())
            fresh = np.flatnonzero(~pol)
            if fresh.shape[0]:
                self.stats.context_promoted += fresh.shape[0]
                nodes = lo + fresh
                self._promos.append((nodes, lps[off + fresh].copy(), version))
                self._promoted.update(nodes.tolist())
                self._policy_count += fresh.shape[0]
            off += hi - lo
        assert off == j

    # -------------------------------------------------------------------------------------- queries

    def call_sequence(self, call_id: str) -> tuple[np.ndarray, np.ndarray]:
        """The exact (input ids, output ids) of a call, rebuilt from the tree."""
        info = self.calls[call_id]
        seq = self.sequence(info.end)
        return seq[: info.n_input], seq[info.n_input :]

    def leaves(self) -> list[CallInfo]:
        """One CallInfo per distinct leaf that some call ends at; a leaf that several calls end at is
        represented by its highest-priority role (ties: the later call)."""
        best: dict[int, CallInfo] = {}
        prio = {r: k for k, r in enumerate(Role)}
        for cid in self.order:
            info = self.calls[cid]
            if info.end == ROOT or self.has_children(info.end):
                continue
            cur = best.get(info.end)
            if cur is None or prio[info.role] <= prio[cur.role]:
                best[info.end] = info
        return list(best.values())

    @property
    def unique_tokens(self) -> int:
        return self.n

    @property
    def policy_tokens(self) -> int:
        return self._policy_count


class Forest:
    """The trees of many executions, fed record by record (calls and scores, any interleaving)."""

    def __init__(self) -> None:
        self.trees: dict[str, ExecutionTree] = {}
        self.pending_scores: dict[str, Score] = {}
        self._view_dec = call_view_decoder()  # `ingest_frame`'s

    def add(self, rec: Call | Score | CallBatch) -> None:
        if isinstance(rec, Score):
            tree = self.trees.get(rec.execution_id)
            if tree is None:
                self.pending_scores[rec.execution_id] = rec
            else:
                tree.score = rec
            return
        tree = self.trees.get(rec.execution_id)
        if tree is None:
            tree = self.trees[rec.execution_id] = ExecutionTree(rec.execution_id)
            tree.score = self.pending_scores.pop(rec.execution_id, None)
        if isinstance(rec, CallBatch):
            tree.add_batch(rec)
        else:
            tree.add(rec)

    def add_all(self, recs: Iterable[Call | Score | CallBatch]) -> Forest:
        for rec in recs:
            self.add(rec)
        return self

    def add_msgpack(self, data: bytes | memoryview, name: str = "<stream>") -> Forest:
        """Ingest a framed msgpack record stream. Token arrays stay views into `data` while decoding and
        the negative-id scan of full inputs is left to the tree (which checks what it stores), so a
        stream of full 700k-token inputs costs about one comparison pass over its bytes."""
        with defer_input_sign_check():
            for rec in iter_msgpack(data, name):
                self.add(rec)
        return self

    def add_frame(self, data: bytes | memoryview, name: str = "<frame>") -> Call | Score | CallBatch:
        """Decode one msgpack record (what the proxy sends as one message: a `Call` whose input is
        delta-encoded against the agent's previous call, most often) into its record and add it;
        returns it. An agent's next call costs work in proportion to the tokens it carries, whatever the
        length of the context it extends. The record's scans are the tree's (as in `add_msgpack`). A
        record that does not decode, or that its tree refuses, is a `RecordError`; the tree keeps what
        it had. `ingest_frame` is the same with no `Call` built for an agent's next call."""
        with defer_input_sign_check():
            rec = decode_msgpack_record(data, name)
            self.add(rec)
        return rec

    def ingest_frame(
        self, data: bytes | memoryview, name: str = "<frame>", view: CallView | None = None
    ) -> CallInfo | Score | CallBatch:
        """The live ingest path, for a service that takes records off a socket one message at a time:
        `add_frame`'s contract, returning the CallInfo the tree gave a call (the record itself for a
        score or a batch). A call goes from the message's bytes straight into its tree, no `Call`
        built. First through the native path when it is in use (`gyre_traj.native`: the message parsed
        in C; an agent's next call, the proxy's usual message, by one checked copy of its tokens; any
        other call of a tree that exists by the merge `add` does). Else, or when that path leaves it
        (anything it is not sure of), an agent's next call through `ExecutionTree.extend_next` (one
        copy of its tokens), any other well-formed call through `ExecutionTree.merge_view` (the merge
        `add` uses). Any other record, or a call neither takes (a bad value, another array encoding),
        is decoded and added in full, which gives the same tree and the same errors.
        `view`: the message already read as a `CallView` (`read_view`), by a caller that looked at it
        first."""
        fast = native.extend_next
        if fast is not None:  # the native path: a call placed from the bytes, or None
            info = fast(data, self.trees)
            if info is not None:
                return info
        info = self._place_view(data, view)
        if info is not None:
            return info
        with defer_input_sign_check():
            rec = decode_msgpack_record(data, name)
            if isinstance(rec, Call):
                return self._add_call(rec)
            self.add(rec)
        return rec

    def ingest_call(self, data: bytes | memoryview, name: str = "<frame>") -> CallInfo:
        """`ingest_frame` for a service that takes call records only: the CallInfo its tree gave the
        call, or `RecordError` for a message that is not a call record (a score, a batch: nothing is
        added) as for a call its tree refuses (its tree keeps what it had)."""
        fast = native.extend_next
        if fast is not None:  # (as in `ingest_frame`)
            info = fast(data, self.trees)
            if info is not None:
                return info
        info = self._place_view(data, None)
        if info is not None:
            return info
        with defer_input_sign_check():
            rec = decode_msgpack_record(data, name)
            if not isinstance(rec, Call):
                raise RecordError(f"{name}: a {type(rec).__name__} record, not a call")
            return self._add_call(rec)

    def _place_view(self, data: bytes | memoryview, view: CallView | None) -> CallInfo | None:
        """A call placed from its message read as a `CallView` (`ingest_frame`'s Python paths short of
        the full decode), or None (nothing changed) for a message neither takes."""
        if view is None:
            try:  # (`read_view`, inline: this runs once per message)
                view = self._view_dec.decode(data)
            except (msgspec.ValidationError, msgspec.DecodeError):
                return None
        tree = self.trees.get(view.execution_id)
        if tree is not None:
            info = tree.extend_next(view)
            if info is not None:
                return info
        return self._merge_view(view, tree)

    def _add_call(self, rec: Call) -> CallInfo:
        """`rec` added to its tree (made for it when its execution is new): its CallInfo."""
        tree = self.trees.get(rec.execution_id)
        if tree is None:
            tree = self.trees[rec.execution_id] = ExecutionTree(rec.execution_id)
            tree.score = self.pending_scores.pop(rec.execution_id, None)
        return tree.add(rec)

    def booked(self, execution_id: str, call_id: str) -> bool:
        """Whether the call `call_id` of that execution is in its tree."""
        tree = self.trees.get(execution_id)
        return tree is not None and call_id in tree.calls

    def _merge_view(self, view: CallView, tree: ExecutionTree | None) -> CallInfo | None:
        """`ExecutionTree.merge_view` in the view's tree; a call of an execution not seen yet gets its
        tree first, registered as the full path registers it (kept when the call is then refused there,
        given back when the call is left to the full path)."""
        if tree is not None:
            return tree.merge_view(view)
        eid = view.execution_id
        tree = self.trees[eid] = ExecutionTree(eid)
        tree.score = self.pending_scores.pop(eid, None)
        info = tree.merge_view(view)
        if info is None:
            del self.trees[eid]
            if tree.score is not None:
                self.pending_scores[eid] = tree.score
        return info

    def read_view(self, data: bytes | memoryview) -> CallView | None:
        """`data` read as a `CallView` (its arrays left in it), or None when it is not one: another kind
        of record, or bytes msgspec refuses (`ingest_frame` then decodes it in full, which says what)."""
        try:
            return self._view_dec.decode(data)
        except (msgspec.ValidationError, msgspec.DecodeError):
            return None

    def __iter__(self) -> Iterator[ExecutionTree]:
        return iter(self.trees.values())

    def __len__(self) -> int:
        return len(self.trees)
