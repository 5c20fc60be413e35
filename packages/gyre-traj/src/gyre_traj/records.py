"""TITO records: one model call as the policy saw it (input ids) and produced it (output ids, logprobs).

A `Call` carries its input either in full (`input_ids`) or delta-encoded against an earlier call of the same
execution (`input_delta`: keep the first `keep` tokens of the parent's input+output, then append ids), so a
700k-token context over 600 calls is stored once, not 600 times. Token arrays are numpy (int32 ids,
float32 logprobs) in memory, lists in JSON and raw little-endian bytes in msgpack. Validation happens on
construction and on decode; every error names the record.
"""

from __future__ import annotations

import contextlib
import enum
import math
import operator
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
import numpy as np

SCHEMA_VERSION = 1

ID_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")
_I32 = np.iinfo(np.int32)
_I64 = np.iinfo(np.int64)
_F32_MAX = float(np.finfo(np.float32).max)
MAX_WEIGHT_VERSION = int(_I32.max)
"""Weight versions are stored as int32 in the tree and in packed batches: a record's must fit."""


class Role(enum.StrEnum):
    """Which agent loop made the call. Order of declaration is the default selection priority."""

    MAIN = "main"
    MAIN_SUMMARY = "main_summary"
    SUBAGENT = "subagent"
    SUBAGENT_SUMMARY = "subagent_summary"


class RecordError(ValueError):
    """A record is malformed or inconsistent. The message names the record (execution and call id)."""


def _where(execution_id: str, call_id: str) -> str:
    return f"record execution={execution_id!r} call={call_id!r}"


_deferred = threading.local()
_fmax = np.maximum.reduce


class _Deferred:
    """The context manager of `defer_input_sign_check` (a class: entered once per record on the live
    path, where a generator-based one costs more than the rest of a small record's decoding)."""

    __slots__ = ("prev",)

    def __enter__(self) -> None:
        self.prev = getattr(_deferred, "on", False)
        _deferred.on = True

    def __exit__(self, *exc: object) -> None:
        _deferred.on = self.prev


def defer_input_sign_check() -> contextlib.AbstractContextManager[None]:
    """Inside this block, `Call` skips the negative-id scans of its token arrays (full `input_ids`: a
    whole pass over what may be hundreds of MB) and the range scan of its logprobs, and `CallBatch` the
    negative-id scan of its tokens. Only for records that go straight into an `ExecutionTree`, which
    checks the sign of every token it stores where it stored it (tokens it matches against the tree are
    already known good) and the logprobs it keeps (`ExecutionTree.add`)."""
    return _Deferred()


def _out_of_int_range(raw: np.ndarray, what: str, lo: int, hi: int, bits: int) -> ValueError | None:
    """The error for an integer (or integral float) array holding a value outside [lo, hi], checked
    before any cast (numpy wraps integers silently and warns on floats)."""
    small, big = raw.min(), raw.max()
    if big > hi or small < lo:
        bad = big if big > hi else small
        shown = f"{float(bad):g}" if raw.dtype.kind == "f" else str(int(bad))
        return ValueError(f"{what} contain a value outside int{bits} range ({shown})")
    return None


def _python_ints_beyond_numpy(raw: np.ndarray, what: str) -> ValueError:
    """The error for an array numpy could not type: integers beyond 64 bits read as Python ints give an
    object array; anything else there is not an integer at all."""
    if raw.size and all(type(x) is int for x in raw.flat):
        return ValueError(f"{what} contain a value outside int64 range")
    return ValueError(f"{what} must be integers, got dtype {raw.dtype}")


def as_ids(values: Any, what: str = "token ids", check_sign: bool = True) -> np.ndarray:
    """Token ids as a contiguous int32 array; rejects negative, fractional or out-of-range values (every
    range checked before the cast to int32)."""
    if isinstance(values, np.ndarray) and values.dtype == ID_DTYPE:
        arr = values
    else:
        raw = np.asarray(values)
        if raw.size == 0:
            return np.zeros(0, ID_DTYPE)
        if raw.dtype.kind == "O":
            raise _python_ints_beyond_numpy(raw, what)
        if raw.dtype.kind == "f":
            if not (np.all(np.isfinite(raw)) and np.all(np.floor(raw) == raw)):
                raise ValueError(f"{what} must be integers, got dtype {raw.dtype}")
        elif raw.dtype.kind not in "iu":
            raise ValueError(f"{what} must be integers, got dtype {raw.dtype}")
        if raw.ndim != 1:
            raise ValueError(f"{what} must be a flat list, got shape {raw.shape}")
        if (err := _out_of_int_range(raw, what, int(_I32.min), int(_I32.max), 32)) is not None:
            raise err
        arr = raw.astype(ID_DTYPE)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be a flat list, got shape {arr.shape}")
    if check_sign and arr.size and int(arr.min()) < 0:
        pos = int(np.flatnonzero(arr < 0)[0])
        raise ValueError(f"{what} contain a negative id {int(arr[pos])} at position {pos}")
    return arr


def as_logprobs(values: Any, check_range: bool = True) -> np.ndarray:
    """Logprobs as a float32 array: numbers <= 0 (a rounding margin of 1e-4 allowed), none NaN, none
    beyond float32's range (checked before the cast, which would make them infinite). Without
    `check_range`, float32 logprobs are taken as they are (the caller checks them: `check_logprobs`)."""
    arr = values if isinstance(values, np.ndarray) else np.asarray(values)
    if arr.dtype.kind not in "iuf":
        raise ValueError(f"logprobs must be numbers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"logprobs must be a flat list, got shape {arr.shape}")
    if arr.dtype.kind == "f" and arr.dtype.itemsize > LOGPROB_DTYPE.itemsize and arr.size:
        big = np.isfinite(arr) & (np.abs(arr) > _F32_MAX)
        if big.any():
            pos = int(np.flatnonzero(big)[0])
            raise ValueError(f"logprobs must fit float32, got {float(arr[pos]):g} at position {pos}")
    arr = arr.astype(LOGPROB_DTYPE, copy=False)
    if check_range:
        check_logprobs(arr)
    return arr


def check_logprobs(arr: np.ndarray) -> None:
    """ValueError unless every float32 logprob is <= 0 (a rounding margin of 1e-4 allowed) and none NaN."""
    if arr.size and not float(_fmax(arr)) <= 1e-4:  # max propagates NaN, so NaN fails this too
        pos = int(np.flatnonzero(~(arr <= 1e-4))[0])
        raise ValueError(f"logprobs must be <= 0 (and not NaN), got {float(arr[pos])} at position {pos}")


class Delta(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Input = parent's (input + output)[:keep] + append. The parent is a call of the same execution."""

    parent: str
    keep: int
    append: np.ndarray


class Call(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    omit_defaults=True,
    forbid_unknown_fields=True,
    tag="call",
    tag_field="kind",
):
    """One model call. Exactly one of `input_ids` / `input_delta` is set."""

    execution_id: str
    call_id: str
    agent_id: str
    role: Role
    output_ids: np.ndarray
    output_logprobs: np.ndarray
    weight_version: int
    finish_reason: str = "stop"
    input_ids: np.ndarray | None = None
    input_delta: Delta | None = None
    t_start: float = 0.0
    t_end: float = 0.0
    v: int = SCHEMA_VERSION
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    """What the writer knows about the call beyond its tokens (empty by default, so older logs read as
    they are; `CallBatch` does not carry it). gyre-proxy writes `extends` (the call id of the same agent's
    previous call when the harness's request only appended to that call's conversation and output: this
    call's input should then start with that call's input + output), `stripped.<rule>` (harness
    metadata text the proxy removed from what the policy saw), `engines` (the ids of the rollout engines
    that served the call, in order, comma-separated) and `cached_tokens` (input tokens its first engine
    took from its prefix cache)."""

    def __post_init__(self) -> None:
        if not self.execution_id or not self.call_id:
            raise RecordError(f"{self.where}: execution_id and call_id must be non-empty")
        if self.v > SCHEMA_VERSION:
            raise RecordError(
                f"{self.where}: schema version {self.v} is newer than this reader ({SCHEMA_VERSION})"
            )
        if (self.input_ids is None) == (self.input_delta is None):
            raise RecordError(f"{self.where}: exactly one of input_ids / input_delta must be given")
        # Inside `defer_input_sign_check` the tree scans what it stores (aligned, in cache), not this
        # decoder (the arrays are views into a frame at any byte offset, where a scan is slower).
        checked = not getattr(_deferred, "on", False)
        try:
            # (set only when converted: decoded arrays already have their dtype)
            out = as_ids(self.output_ids, "output ids", check_sign=checked)
            if out is not self.output_ids:
                msgspec.structs.force_setattr(self, "output_ids", out)
            lps = as_logprobs(self.output_logprobs, check_range=checked)
            if lps is not self.output_logprobs:
                msgspec.structs.force_setattr(self, "output_logprobs", lps)
            if self.input_ids is not None:
                ids = as_ids(self.input_ids, "input ids", check_sign=checked)
                if ids is not self.input_ids:
                    msgspec.structs.force_setattr(self, "input_ids", ids)
            if self.input_delta is not None:
                d = self.input_delta
                if d.keep < 0:
                    raise ValueError(f"input_delta.keep must be >= 0, got {d.keep}")
                if d.keep > _I64.max:
                    raise ValueError(f"input_delta.keep must be <= {_I64.max} (int64), got {d.keep}")
                if d.parent == self.call_id:
                    raise ValueError("input_delta.parent names the call itself")
                append = as_ids(d.append, "input_delta.append ids", check_sign=checked)
                if append is not d.append:
                    msgspec.structs.force_setattr(d, "append", append)
        except ValueError as exc:
            raise RecordError(f"{self.where}: {exc}") from None
        if lps.shape[0] != out.shape[0]:
            raise RecordError(
                f"{self.where}: {lps.shape[0]} output logprobs for {out.shape[0]} output ids (must be equal)"
            )
        if self.weight_version < 0:
            raise RecordError(f"{self.where}: weight_version must be >= 0, got {self.weight_version}")
        if self.weight_version > MAX_WEIGHT_VERSION:
            raise RecordError(
                f"{self.where}: weight_version must be <= {MAX_WEIGHT_VERSION} (int32), got {self.weight_version}"
            )
        if math.isnan(self.t_start) or math.isnan(self.t_end):
            raise RecordError(f"{self.where}: timestamps must not be NaN")

    @property
    def where(self) -> str:
        return _where(self.execution_id, self.call_id)

    def with_full_input(self, input_ids: np.ndarray) -> Call:
        """The same call with its input given in full (used to re-encode delta records)."""
        return msgspec.structs.replace(self, input_ids=as_ids(input_ids), input_delta=None)


def _int_column(values: Any, what: str, n: int, hi: int = int(_I64.max)) -> np.ndarray:
    """One non-negative integer per call, as int64, each at most `hi` (checked before the cast)."""
    if isinstance(values, np.ndarray) and values.dtype == np.int64 and values.shape == (n,):
        # As decoded (the common case): only the sign and the bound to check.
        if n and int(values.min()) < 0:
            pos = int(np.flatnonzero(values < 0)[0])
            raise ValueError(f"{what} must be >= 0, got {int(values[pos])} for call #{pos}")
        if n and hi < _I64.max and int(values.max()) > hi:
            pos = int(np.flatnonzero(values > hi)[0])
            raise ValueError(f"{what} must be <= {hi}, got {int(values[pos])} for call #{pos}")
        return values
    arr = np.asarray(values)
    if arr.size == 0:
        arr = np.zeros(0, np.int64)
    if arr.ndim != 1 or arr.shape[0] != n:
        raise ValueError(f"{what} must hold one integer per call ({n}), got shape {arr.shape}")
    if arr.dtype.kind == "O":
        raise _python_ints_beyond_numpy(arr, what)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{what} must be integers, got dtype {arr.dtype}")
    if n and int(arr.min()) < 0:
        pos = int(np.flatnonzero(arr < 0)[0])
        raise ValueError(f"{what} must be >= 0, got {int(arr[pos])} for call #{pos}")
    if n and int(arr.max()) > hi:  # a uint64 above int64's range would wrap in the cast
        pos = int(np.flatnonzero(arr > hi)[0])
        raise ValueError(f"{what} must be <= {hi}, got {int(arr[pos])} for call #{pos}")
    return arr.astype(np.int64, copy=False)


def _float_column(values: Any, what: str, n: int) -> np.ndarray:
    """One number per call, as float64, none NaN (an integer beyond float64 is refused, not cast)."""
    arr = np.asarray(values)
    if arr.dtype.kind not in "iuf":
        raise ValueError(f"{what} must be numbers, got dtype {arr.dtype}")
    if arr.shape != (n,):
        raise ValueError(f"{what} must hold one value per call ({n}), got shape {arr.shape}")
    arr = arr.astype(np.float64, copy=False)
    if bool(np.isnan(arr).any()):
        raise ValueError(f"{what}: timestamps must not be NaN")
    return arr


def _indices_of_empty(items: list[str]) -> list[int]:
    """Indices of the empty strings in `items` (one C-level scan per hit, not a Python loop per item)."""
    out: list[int] = []
    i = -1
    with contextlib.suppress(ValueError):
        while True:
            i = items.index("", i + 1)
            out.append(i)
    return out


def _offsets(n_in: np.ndarray, n_out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    tok_off = np.zeros(n_in.shape[0] + 1, np.int64)
    np.cumsum(n_in + n_out, out=tok_off[1:])
    lp_off = np.zeros(n_out.shape[0] + 1, np.int64)
    np.cumsum(n_out, out=lp_off[1:])
    return tok_off, lp_off


class CallBatch(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    omit_defaults=True,
    forbid_unknown_fields=True,
    tag="calls",
    tag_field="kind",
):
    """Many calls of one execution, stored by column: the same content as the `Call`s it was built from,
    in far fewer and larger pieces. Call k's tokens are `tokens[tok_off[k]:tok_off[k+1]]`: first its input
    (the appended ids when `parents[k]` is set, else the full input), then its output; its logprobs are
    `logprobs[lp_off[k]:lp_off[k+1]]`. Decoding a batch is one message and a few array views whatever the
    number of calls, and `ExecutionTree.add_batch` ingests it without a Python object per call.
    `CallBatch.of(calls)` builds one; `batch.calls()` gives the `Call`s back."""

    execution_id: str
    call_ids: list[str]
    agent_ids: list[str]
    roles: list[Role]
    finish_reasons: list[str]
    parents: list[str]
    """The delta parent of each call, or "" for a call whose input is given in full."""
    keeps: np.ndarray
    input_lens: np.ndarray
    output_lens: np.ndarray
    weight_versions: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray
    t_start: np.ndarray
    t_end: np.ndarray
    v: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        n = len(self.call_ids)
        where = f"call batch execution={self.execution_id!r} ({n} calls)"
        if not self.execution_id:
            raise RecordError(f"{where}: execution_id must be non-empty")
        if self.v > SCHEMA_VERSION:
            raise RecordError(
                f"{where}: schema version {self.v} is newer than this reader ({SCHEMA_VERSION})"
            )
        for name in ("agent_ids", "roles", "finish_reasons", "parents"):
            if len(getattr(self, name)) != n:
                raise RecordError(f"{where}: {name} has {len(getattr(self, name))} entries for {n} calls")
        if len(set(self.call_ids)) != n or not all(self.call_ids):
            empty = [i for i, c in enumerate(self.call_ids) if not c]
            what = f"call #{empty[0]} has an empty call id" if empty else "call ids repeat inside the batch"
            raise RecordError(f"{where}: {what}")
        try:
            keeps = _int_column(self.keeps, "keeps", n)
            n_in = _int_column(self.input_lens, "input_lens", n)
            n_out = _int_column(self.output_lens, "output_lens", n)
            versions = _int_column(self.weight_versions, "weight_versions", n, MAX_WEIGHT_VERSION)
            t0 = _float_column(self.t_start, "t_start", n)
            t1 = _float_column(self.t_end, "t_end", n)
            lps = as_logprobs(self.logprobs)
            toks = as_ids(self.tokens, "token ids", check_sign=False)
        except ValueError as exc:
            raise RecordError(f"{where}: {exc}") from None
        n_outputs = int(n_out.sum())
        n_tokens = int(n_in.sum()) + n_outputs
        if n_tokens != toks.shape[0]:
            raise RecordError(
                f"{where}: input_lens + output_lens add up to {n_tokens} tokens, the batch holds "
                f"{toks.shape[0]}"
            )
        if n_outputs != lps.shape[0]:
            raise RecordError(
                f"{where}: output_lens add up to {n_outputs} output tokens, the batch holds "
                f"{lps.shape[0]} logprobs (must be equal)"
            )
        if any(map(operator.eq, self.call_ids, self.parents)):  # one C loop; the error path finds which
            k = next(i for i, (c, p) in enumerate(zip(self.call_ids, self.parents, strict=True)) if c == p)
            raise RecordError(
                f"{_where(self.execution_id, self.call_ids[k])}: input_delta.parent names the call itself"
            )
        full = _indices_of_empty(self.parents)  # calls with their input in full
        if full and bool(keeps[full].any()):
            k = next(i for i in full if keeps[i])
            raise RecordError(
                f"{_where(self.execution_id, self.call_ids[k])}: keep={int(keeps[k])} without a delta parent"
            )
        set_ = msgspec.structs.force_setattr
        set_(self, "keeps", keeps)
        set_(self, "input_lens", n_in)
        set_(self, "output_lens", n_out)
        set_(self, "weight_versions", versions)
        set_(self, "t_start", t0)
        set_(self, "t_end", t1)
        set_(self, "tokens", toks)
        set_(self, "logprobs", lps)
        # Inside `defer_input_sign_check` the tree checks instead, piece by piece as it copies the tokens
        # it stores (`ExecutionTree.add_batch`), so the bytes are read once.
        if (
            not getattr(_deferred, "on", False)
            and toks.shape[0]
            and int(toks.view(np.uint32).max()) >= 1 << 31
        ):
            self.raise_negative()

    def raise_negative(self) -> None:
        """Raise the RecordError for the first negative id of the batch's tokens, naming its call and
        position."""
        toks, n_in = self.tokens, self.input_lens
        tok_off, _ = self.offsets()
        pos = int(np.flatnonzero(toks < 0)[0])
        k = int(np.searchsorted(tok_off, pos, side="right")) - 1
        rel = pos - int(tok_off[k])
        cid = self.call_ids[k]
        if rel < int(n_in[k]):
            what = "input_delta.append ids" if self.parents[k] else "input ids"
            raise RecordError(
                f"{_where(self.execution_id, cid)}: {what} contain a negative id {int(toks[pos])} at position {rel}"
            )
        raise RecordError(
            f"{_where(self.execution_id, cid)}: output ids contain a negative id {int(toks[pos])} "
            f"at position {rel - int(n_in[k])}"
        )

    def __len__(self) -> int:
        return len(self.call_ids)

    def offsets(self) -> tuple[np.ndarray, np.ndarray]:
        """(token offsets, logprob offsets), each of length len(batch) + 1."""
        return _offsets(self.input_lens, self.output_lens)

    @classmethod
    def of(cls, calls: Sequence[Call]) -> CallBatch:
        """One batch holding `calls` (all of one execution, in order)."""
        if not calls:
            raise ValueError("a call batch needs at least one call")
        eid = calls[0].execution_id
        for c in calls:
            if c.execution_id != eid:
                raise ValueError(f"{c.where}: a batch holds one execution's calls ({eid!r})")
        toks: list[np.ndarray] = []
        for c in calls:
            toks.append(c.input_ids if c.input_delta is None else c.input_delta.append)  # type: ignore[arg-type]
            toks.append(c.output_ids)
        return cls(
            execution_id=eid,
            call_ids=[c.call_id for c in calls],
            agent_ids=[c.agent_id for c in calls],
            roles=[c.role for c in calls],
            finish_reasons=[c.finish_reason for c in calls],
            parents=["" if c.input_delta is None else c.input_delta.parent for c in calls],
            keeps=np.array([0 if c.input_delta is None else c.input_delta.keep for c in calls], np.int64),
            input_lens=np.array([t.shape[0] for t in toks[0::2]], np.int64),
            output_lens=np.array([c.output_ids.shape[0] for c in calls], np.int64),
            weight_versions=np.array([c.weight_version for c in calls], np.int64),
            tokens=np.concatenate(toks).astype(ID_DTYPE, copy=False),
            logprobs=np.concatenate([c.output_logprobs for c in calls]).astype(LOGPROB_DTYPE, copy=False),
            t_start=np.array([c.t_start for c in calls], np.float64),
            t_end=np.array([c.t_end for c in calls], np.float64),
        )

    def calls(self) -> Iterator[Call]:
        """The batch's calls, one `Call` each (token arrays are views into the batch)."""
        tok_off, lp_off = self.offsets()
        for k, cid in enumerate(self.call_ids):
            a, m, b = int(tok_off[k]), int(tok_off[k] + self.input_lens[k]), int(tok_off[k + 1])
            inp = self.tokens[a:m]
            par = self.parents[k]
            yield Call(
                execution_id=self.execution_id,
                call_id=cid,
                agent_id=self.agent_ids[k],
                role=self.roles[k],
                output_ids=self.tokens[m:b],
                output_logprobs=self.logprobs[int(lp_off[k]) : int(lp_off[k + 1])],
                weight_version=int(self.weight_versions[k]),
                finish_reason=self.finish_reasons[k],
                input_ids=None if par else inp,
                input_delta=Delta(par, int(self.keeps[k]), inp) if par else None,
                t_start=float(self.t_start[k]),
                t_end=float(self.t_end[k]),
            )


def _finite_number(value: object) -> bool:
    """Whether `value` is an int or float (not a bool) that float64 holds as a finite number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond float64
        return False


class EvalStatus(enum.StrEnum):
    OK = "ok"
    EVAL_FAILED = "eval_failed"


class Score(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    omit_defaults=True,
    forbid_unknown_fields=True,
    tag="score",
    tag_field="kind",
):
    """The evaluation of one execution. `value` is any finite number when status is ok (rewards come on
    any scale; partial scores of timed-out executions included, flagged `timed_out`); an evaluation
    failure carries no value and is not a 0."""

    execution_id: str
    group_id: str
    value: float | None = None
    status: EvalStatus = EvalStatus.OK
    timed_out: bool = False
    detail: str = ""
    v: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        where = f"score execution={self.execution_id!r}"
        if self.status is EvalStatus.OK:
            if not _finite_number(self.value):
                raise RecordError(
                    f"{where}: an ok score needs a finite number as its value, got {self.value!r:.60}"
                )
            msgspec.structs.force_setattr(self, "value", float(self.value))  # type: ignore[arg-type]
        elif self.value is not None:
            raise RecordError(f"{where}: an evaluation failure carries no value (got {self.value!r})")
