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
import threading
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np

SCHEMA_VERSION = 1

ID_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")


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


@contextlib.contextmanager
def defer_input_sign_check() -> Iterator[None]:
    """Inside this block, `Call` skips the negative-id scan of full `input_ids` (a whole pass over
    what may be hundreds of MB). Only for records that go straight into an `ExecutionTree`, which checks
    the sign of every token it stores; tokens it matches against the tree are already known good."""
    prev = getattr(_deferred, "on", False)
    _deferred.on = True
    try:
        yield
    finally:
        _deferred.on = prev


def as_ids(values: Any, what: str = "token ids", check_sign: bool = True) -> np.ndarray:
    """Token ids as a contiguous int32 array; rejects negative, fractional or out-of-range values."""
    if isinstance(values, np.ndarray) and values.dtype == ID_DTYPE:
        arr = values
    else:
        raw = np.asarray(values)
        if raw.size == 0:
            return np.zeros(0, ID_DTYPE)
        if raw.dtype.kind not in "iu":
            if raw.dtype.kind == "f" and np.all(np.floor(raw) == raw):
                raw = raw.astype(np.int64)
            else:
                raise ValueError(f"{what} must be integers, got dtype {raw.dtype}")
        if raw.ndim != 1:
            raise ValueError(f"{what} must be a flat list, got shape {raw.shape}")
        if raw.size and (int(raw.max()) > np.iinfo(ID_DTYPE).max):
            raise ValueError(f"{what} contain a value above int32 range ({int(raw.max())})")
        arr = raw.astype(ID_DTYPE)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be a flat list, got shape {arr.shape}")
    if check_sign and arr.size and int(arr.min()) < 0:
        pos = int(np.flatnonzero(arr < 0)[0])
        raise ValueError(f"{what} contain a negative id {int(arr[pos])} at position {pos}")
    return arr


def as_logprobs(values: Any) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64) if not isinstance(values, np.ndarray) else values
    if arr.ndim != 1:
        raise ValueError(f"logprobs must be a flat list, got shape {arr.shape}")
    arr = arr.astype(LOGPROB_DTYPE, copy=False)
    if arr.size and not bool(np.all(arr <= 1e-4)):
        pos = int(np.flatnonzero(~(arr <= 1e-4))[0])
        raise ValueError(f"logprobs must be <= 0 (and not NaN), got {float(arr[pos])} at position {pos}")
    return arr


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

    def __post_init__(self) -> None:
        where = _where(self.execution_id, self.call_id)
        if not self.execution_id or not self.call_id:
            raise RecordError(f"{where}: execution_id and call_id must be non-empty")
        if self.v > SCHEMA_VERSION:
            raise RecordError(
                f"{where}: schema version {self.v} is newer than this reader ({SCHEMA_VERSION})"
            )
        if (self.input_ids is None) == (self.input_delta is None):
            raise RecordError(f"{where}: exactly one of input_ids / input_delta must be given")
        try:
            out = as_ids(self.output_ids, "output ids")
            lps = as_logprobs(self.output_logprobs)
            msgspec.structs.force_setattr(self, "output_ids", out)
            msgspec.structs.force_setattr(self, "output_logprobs", lps)
            if self.input_ids is not None:
                trusted = getattr(_deferred, "on", False)
                ids = as_ids(self.input_ids, "input ids", check_sign=not trusted)
                msgspec.structs.force_setattr(self, "input_ids", ids)
            if self.input_delta is not None:
                d = self.input_delta
                if d.keep < 0:
                    raise ValueError(f"input_delta.keep must be >= 0, got {d.keep}")
                if d.parent == self.call_id:
                    raise ValueError("input_delta.parent names the call itself")
                msgspec.structs.force_setattr(d, "append", as_ids(d.append, "input_delta.append ids"))
        except ValueError as exc:
            raise RecordError(f"{where}: {exc}") from None
        if lps.shape[0] != out.shape[0]:
            raise RecordError(
                f"{where}: {lps.shape[0]} output logprobs for {out.shape[0]} output ids (must be equal)"
            )
        if self.weight_version < 0:
            raise RecordError(f"{where}: weight_version must be >= 0, got {self.weight_version}")
        if math.isnan(self.t_start) or math.isnan(self.t_end):
            raise RecordError(f"{where}: timestamps must not be NaN")

    @property
    def where(self) -> str:
        return _where(self.execution_id, self.call_id)

    def with_full_input(self, input_ids: np.ndarray) -> Call:
        """The same call with its input given in full (used to re-encode delta records)."""
        return msgspec.structs.replace(self, input_ids=as_ids(input_ids), input_delta=None)


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
    """The evaluation of one execution. `value` in [0, 1] when status is ok (partial scores of timed-out
    executions included, flagged `timed_out`); an evaluation failure carries no value and is not a 0."""

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
            if self.value is None or not (0.0 <= self.value <= 1.0):
                raise RecordError(f"{where}: an ok score needs a value in [0, 1], got {self.value!r}")
        elif self.value is not None:
            raise RecordError(f"{where}: an evaluation failure carries no value (got {self.value!r})")
