"""The trajectory tree of one execution: every call's input+output merged on shared token prefixes.

Tokens live once in an append-only arena (ids, parent, depth, policy flag, behaviour logprob, weight
version). A run is a stretch of the arena appended together: inside it each token's parent is the one
before it, so matching a new call against the tree is a few bulk array comparisons, not a loop over
tokens. Branch points keep their extra children in a dict. A token the policy produced stays a policy
token whatever later calls carry it as; a later call whose context contradicts a policy token is
recorded as a `Drift` and becomes its own branch (its output is still trained in the context it saw).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from gyre_traj.records import ID_DTYPE, LOGPROB_DTYPE, Call, RecordError, Role, Score, defer_input_sign_check

ROOT = -1


@dataclass(frozen=True, slots=True)
class CallInfo:
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


def _first_mismatch(a: np.ndarray, b: np.ndarray) -> int:
    """Index of the first position where a and b differ, or their (equal) length."""
    n = a.shape[0]
    # Compare in chunks so a long matching prefix is cheap and an early mismatch exits early.
    step = 1 << 16
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        if not np.array_equal(a[lo:hi], b[lo:hi]):
            return lo + int(np.argmax(a[lo:hi] != b[lo:hi]))
    return n


class ExecutionTree:
    """Prefix tree of one execution's calls. Add calls in an order where delta parents come first."""

    def __init__(self, execution_id: str, capacity: int = 1 << 12) -> None:
        self.execution_id = execution_id
        self.n = 0
        self.ids = np.zeros(capacity, ID_DTYPE)
        self.parent = np.zeros(capacity, np.int32)
        self.depth = np.zeros(capacity, np.int32)
        self.policy = np.zeros(capacity, np.bool_)
        self.logprob = np.zeros(capacity, LOGPROB_DTYPE)
        self.version = np.full(capacity, -1, np.int32)
        self._run_starts: list[int] = []
        self._branches: dict[int, dict[int, int]] = {}
        self.calls: dict[str, CallInfo] = {}
        self._ends: set[int] = set()
        self.order: list[str] = []
        self.stats = IngestStats()
        self.score: Score | None = None

    # ------------------------------------------------------------------------------------- storage

    def _reserve(self, extra: int) -> None:
        need = self.n + extra
        cap = self.ids.shape[0]
        if need <= cap:
            return
        # Grow 4x: each growth copies what is stored, and fresh pages are only touched when written, so
        # the unused tail costs address space, not memory.
        new_cap = max(need, cap * 4)
        for name in ("ids", "parent", "depth", "policy", "logprob", "version"):
            old = getattr(self, name)
            grown = np.empty(new_cap, old.dtype)
            grown[: self.n] = old[: self.n]
            setattr(self, name, grown)

    def _append(
        self, after: int, tokens: np.ndarray, policy: bool, logprobs: np.ndarray | None, version: int
    ) -> int:
        """Append `tokens` as a chain below node `after`; returns the last new node."""
        k = tokens.shape[0]
        if k == 0:
            return after
        self._reserve(k)
        lo, hi = self.n, self.n + k
        if after != self.n - 1 or after == ROOT:
            # A new run (a branch, or the first tokens of the tree). Extending the arena's last token
            # in place needs no bookkeeping: it just continues the last run.
            self._run_starts.append(lo)
            if after != ROOT or self.n > 0:
                self._branches.setdefault(after, {})[int(tokens[0])] = lo
        self.ids[lo:hi] = tokens
        self.parent[lo] = after
        self.parent[lo + 1 : hi] = np.arange(lo, hi - 1, dtype=np.int32)
        d0 = 0 if after == ROOT else int(self.depth[after]) + 1
        self.depth[lo:hi] = np.arange(d0, d0 + k, dtype=np.int32)
        self.policy[lo:hi] = policy
        if policy:
            assert logprobs is not None
            self.logprob[lo:hi] = logprobs
            self.version[lo:hi] = version
        else:
            self.logprob[lo:hi] = 0.0
            self.version[lo:hi] = -1
        self.n = hi
        return hi - 1

    def _run_end(self, node: int) -> int:
        r = bisect.bisect_right(self._run_starts, node)
        return self._run_starts[r] if r < len(self._run_starts) else self.n

    def _run_start(self, node: int) -> int:
        return self._run_starts[bisect.bisect_right(self._run_starts, node) - 1]

    def children(self, node: int) -> list[int]:
        out = []
        if node != ROOT and node + 1 < self.n and self.parent[node + 1] == node:
            out.append(node + 1)
        elif node == ROOT and self.n > 0:
            out.append(0)
        out.extend(v for v in self._branches.get(node, {}).values() if v not in out)
        return out

    def _child(self, node: int, tok: int) -> int:
        if node == ROOT:
            if self.n > 0 and int(self.ids[0]) == tok:
                return 0
        else:
            c = node + 1
            if c < self.n and self.parent[c] == node and int(self.ids[c]) == tok:
                return c
        b = self._branches.get(node)
        return b.get(tok, ROOT - 1) if b is not None else ROOT - 1

    def _descend(self, node: int, seq: np.ndarray, i: int) -> tuple[int, int]:
        """Follow seq[i:] down from `node` while the tree agrees; returns (last matched node, next i)."""
        n_seq = seq.shape[0]
        while i < n_seq:
            nxt = self._child(node, int(seq[i]))
            if nxt < ROOT:
                return node, i
            span = min(self._run_end(nxt) - nxt, n_seq - i)
            m = _first_mismatch(self.ids[nxt : nxt + span], seq[i : i + span])
            node, i = nxt + m - 1, i + m
        return node, i

    def path_slices(self, end: int, from_depth: int = 0) -> list[tuple[int, int]]:
        """Arena slices [lo, hi) covering the root-to-`end` path from depth `from_depth`, root first."""
        out: list[tuple[int, int]] = []
        node = end
        while node != ROOT:
            start = self._run_start(node)
            d_start = int(self.depth[start])
            if d_start <= from_depth:
                lo = start + (from_depth - d_start)
                if lo <= node:
                    out.append((lo, node + 1))
                break
            out.append((start, node + 1))
            node = int(self.parent[start])
        out.reverse()
        return out

    def node_at_depth(self, end: int, depth: int) -> int:
        """The ancestor of `end` at `depth` (ROOT for depth -1)."""
        if depth < 0:
            return ROOT
        node = end
        while node != ROOT:
            start = self._run_start(node)
            d_start = int(self.depth[start])
            if d_start <= depth:
                return start + (depth - d_start)
            node = int(self.parent[start])
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
        return np.concatenate([self.ids[lo:hi] for lo, hi in sl])

    # --------------------------------------------------------------------------------------- ingest

    def add(self, call: Call) -> CallInfo:
        """Merge one call. Raises RecordError naming the call if it is inconsistent with the tree."""
        if call.execution_id != self.execution_id:
            raise RecordError(
                f"{call.where}: belongs to execution {call.execution_id!r}, not {self.execution_id!r}"
            )
        if call.call_id in self.calls:
            raise RecordError(f"{call.where}: duplicate call id in this execution")
        st = self.stats
        out = call.output_ids
        if call.input_delta is not None:
            d = call.input_delta
            par = self.calls.get(d.parent)
            if par is None:
                raise RecordError(
                    f"{call.where}: input_delta names unknown parent call {d.parent!r} "
                    f"(parents must come before the calls that extend them)"
                )
            if d.keep > par.length:
                raise RecordError(
                    f"{call.where}: input_delta.keep={d.keep} exceeds parent {d.parent!r} length {par.length}"
                )
            start = self.node_at_depth(par.end, d.keep - 1)
            cut_parent = par
            rest, base = d.append, d.keep
            st.delta_calls += 1
        else:
            assert call.input_ids is not None
            start, rest, base = ROOT, call.input_ids, 0
            cut_parent = None
        n_in = base + rest.shape[0]
        node, i = self._descend(start, rest, 0)
        if i < rest.shape[0]:
            if int(rest[i:].min()) < 0:  # the part matched against the tree is known non-negative
                pos = i + int(np.flatnonzero(rest[i:] < 0)[0])
                raise RecordError(
                    f"{call.where}: input ids contain a negative id {int(rest[pos])} at position {base + pos}"
                )
            self._note_drift(call, node, int(rest[i]), base + i, cut_parent)
            node = self._append(node, rest[i:], False, None, -1)
        in_end = node
        node, j = self._descend(in_end, out, 0)
        if j > 0:
            self._promote(in_end, node, call, j)
        if j < out.shape[0]:
            node = self._append(node, out[j:], True, call.output_logprobs[j:], call.weight_version)
        info = CallInfo(
            call.call_id,
            call.agent_id,
            call.role,
            node,
            n_in,
            out.shape[0],
            call.weight_version,
            call.finish_reason,
            call.t_start,
            call.t_end,
        )
        self.calls[call.call_id] = info
        self._ends.add(node)
        self.order.append(call.call_id)
        st.calls += 1
        st.call_tokens += info.length
        return info

    def _note_drift(self, call: Call, node: int, got: int, position: int, parent: CallInfo | None) -> None:
        """Divergence at `node`: drift when the context contradicts a policy output it continues, that is
        the cut falls inside the delta parent's output, or inside a policy span (the matched token and a
        policy child, and no call ends at the matched token). A divergence at an output's first token with no delta parent is a branch (a
        discarded retry looks the same), not drift."""
        if (
            parent is not None
            and parent.n_input <= position < parent.length
            and self.node_at_depth(parent.end, position - 1) == node
        ):  # still on the parent's path
            theirs = self.node_at_depth(parent.end, position)
            if self.policy[theirs]:
                self.stats.drifts.append(Drift(call.call_id, position, (int(self.ids[theirs]),), got))
                return
        if node == ROOT or not self.policy[node] or node in self._ends:
            return
        expected = tuple(int(self.ids[c]) for c in self.children(node) if self.policy[c])
        if expected:
            self.stats.drifts.append(Drift(call.call_id, position, expected, got))

    def _promote(self, in_end: int, node: int, call: Call, j: int) -> None:
        """Output tokens out[:j] matched the existing path in_end -> node: context becomes policy."""
        d0 = 0 if in_end == ROOT else int(self.depth[in_end]) + 1
        off = 0
        for lo, hi in self.path_slices(node, d0):
            pol = self.policy[lo:hi]
            self.stats.output_matched_existing += int(pol.sum())
            fresh = ~pol
            if fresh.any():
                idx = np.flatnonzero(fresh)
                self.stats.context_promoted += idx.shape[0]
                self.policy[lo + idx] = True
                self.logprob[lo + idx] = call.output_logprobs[off + idx]
                self.version[lo + idx] = call.weight_version
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
        has_child = np.zeros(self.n, np.bool_)
        inner = self.parent[: self.n]
        has_child[inner[inner >= 0]] = True
        best: dict[int, CallInfo] = {}
        prio = {r: k for k, r in enumerate(Role)}
        for cid in self.order:
            info = self.calls[cid]
            if info.end == ROOT or has_child[info.end]:
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
        return int(self.policy[: self.n].sum())


class Forest:
    """The trees of many executions, fed record by record (calls and scores, any interleaving)."""

    def __init__(self) -> None:
        self.trees: dict[str, ExecutionTree] = {}
        self.pending_scores: dict[str, Score] = {}

    def add(self, rec: Call | Score) -> None:
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
        tree.add(rec)

    def add_all(self, recs: Iterable[Call | Score]) -> Forest:
        for rec in recs:
            self.add(rec)
        return self

    def add_msgpack(self, data: bytes | memoryview, name: str = "<stream>") -> Forest:
        """Ingest a framed msgpack record stream. Token arrays stay views into `data` while decoding and
        the negative-id scan of full inputs is left to the tree (which checks what it stores), so a
        stream of full 700k-token inputs costs about one comparison pass over its bytes."""
        from gyre_traj.io import iter_msgpack

        with defer_input_sign_check():
            for rec in iter_msgpack(data, name):
                self.add(rec)
        return self

    def __iter__(self) -> Iterator[ExecutionTree]:
        return iter(self.trees.values())

    def __len__(self) -> int:
        return len(self.trees)
