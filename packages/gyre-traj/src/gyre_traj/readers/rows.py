"""What the readers of other systems' rows share: decoding a JSON row, reading a reward, a weight
version and a token field from it, and turning one recorded trajectory (prompt ids, then a response in
which a mask marks the tokens the policy sampled) into the chain of `Call`s that produced it.

Every error is a `RecordError` naming the row (`file:line`) and the field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import msgspec
import numpy as np

from gyre_traj.records import (
    ID_DTYPE,
    MAX_WEIGHT_VERSION,
    Call,
    Delta,
    RecordError,
    Role,
    Score,
    as_ids,
    as_logprobs,
)

_ROW = msgspec.json.Decoder(dict[str, Any])


def decode_row(line: bytes | str, where: str) -> dict[str, Any]:
    """One JSON object. Python's `json.dumps` (verl's and slime's writer) writes non-finite floats as
    `NaN` / `Infinity`, which strict JSON has not: such a row is decoded all the same, so the field
    holding the value can be named when it is refused."""
    try:
        return _ROW.decode(line)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):
            raise RecordError(f"{where}: not a JSON object ({exc})") from None
        if not isinstance(obj, dict):
            raise RecordError(f"{where}: a row must be a JSON object, got {type(obj).__name__}") from None
        return obj


def rows(lines: Iterable[bytes | str], name: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(`name:line`, decoded object) for each non-blank line."""
    for lineno, line in enumerate(lines, 1):
        if line.strip():
            where = f"{name}:{lineno}"
            yield where, decode_row(line, where)


def number(raw: Any, where: str, field: str) -> float:
    """A finite number (int or float, not a bool) as a float."""
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise RecordError(f"{where}: `{field}` must be a number, got {raw!r:.60}")
    try:
        value = float(raw)
    except OverflowError:
        raise RecordError(f"{where}: `{field}` is beyond float64's range ({raw!r:.40})") from None
    if not math.isfinite(value):
        raise RecordError(f"{where}: `{field}` is {value}: a reward must be a finite number")
    return value


def reward(raw: Any, where: str, field: str, key: str | None) -> float | None:
    """A row's reward: None when the row has none (unscored), else a finite number. A reward given as a
    dict (several reward components) needs `key` to name the one to train on."""
    if raw is None:
        return None
    if isinstance(raw, dict):
        if key is None:
            raise RecordError(
                f"{where}: `{field}` is a dict (keys {sorted(raw)[:8]}); name the entry to train on "
                "(reward_key=..., `--reward-key` on the command line)"
            )
        if key not in raw:
            raise RecordError(f"{where}: `{field}` has no key {key!r} (keys {sorted(raw)[:8]})")
        return number(raw[key], where, f"{field}.{key}")
    return number(raw, where, field)


def version(raw: Any, where: str, field: str) -> int:
    """A weight version: an integer, a string of digits, or SGLang's "default" (an engine whose weights
    were never updated: version 0)."""
    if isinstance(raw, str):
        text = raw.strip()
        if text == "default":
            return 0
        if text.isascii() and text.isdigit():
            raw = int(text)
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise RecordError(f"{where}: `{field}` must be an integer or a string of digits, got {raw!r:.60}")
    if not 0 <= raw <= MAX_WEIGHT_VERSION:
        raise RecordError(f"{where}: `{field}` must be in [0, {MAX_WEIGHT_VERSION}] (int32), got {raw}")
    return raw


def ids(raw: Any, where: str, field: str) -> np.ndarray:
    """A flat list of token ids (each checked before its cast to int32)."""
    if not isinstance(raw, list):
        raise RecordError(f"{where}: `{field}` must be a list of token ids, got {type(raw).__name__}")
    try:
        return as_ids(raw, f"`{field}`")
    except ValueError as exc:
        raise RecordError(f"{where}: {exc}") from None


def floats(raw: Any, where: str, field: str) -> np.ndarray:
    """A flat list of numbers as float64 (logprobs are range-checked where they are used)."""
    if not isinstance(raw, list):
        raise RecordError(f"{where}: `{field}` must be a list of numbers, got {type(raw).__name__}")
    if not all(isinstance(x, int | float) and not isinstance(x, bool) for x in raw):
        bad = next(x for x in raw if not isinstance(x, int | float) or isinstance(x, bool))
        raise RecordError(f"{where}: `{field}` must hold numbers only, got {bad!r:.40}")
    try:
        return np.array(raw, np.float64)
    except OverflowError:
        raise RecordError(f"{where}: `{field}` holds an integer beyond float64's range") from None


def mask(raw: Any, where: str, field: str, n: int) -> np.ndarray:
    """A 0/1 mask of length `n` as booleans."""
    if not isinstance(raw, list) or len(raw) != n:
        got = f"{len(raw)} entries" if isinstance(raw, list) else type(raw).__name__
        raise RecordError(f"{where}: `{field}` must be a list of {n} zeros and ones, got {got}")
    if not all(x in (0, 1) and not isinstance(x, float) for x in raw):
        bad = next(x for x in raw if x not in (0, 1) or isinstance(x, float))
        raise RecordError(f"{where}: `{field}` must hold 0 and 1 only, got {bad!r:.40}")
    return np.array(raw, np.bool_)


def sampled_runs(sampled: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first index, end index) of each maximal run of True in `sampled`: the model's turns."""
    starts = np.flatnonzero(sampled & ~np.concatenate(([False], sampled[:-1])))
    ends = np.flatnonzero(sampled & ~np.concatenate((sampled[1:], [False]))) + 1
    return starts, ends


def trajectory_calls(
    *,
    where: str,
    execution_id: str,
    call_prefix: str,
    prompt: np.ndarray,
    response: np.ndarray,
    sampled: np.ndarray,
    logprobs: np.ndarray,
    logprob_field: str,
    versions: Sequence[int],
    last_finish: str,
    agent_id: str = "main",
    role: Role = Role.MAIN,
) -> list[Call]:
    """The calls that produced one trajectory. Each maximal run of sampled response tokens is one call's
    output; its input is everything before it: the first call's in full, every later call's as a delta
    on the call before it (keep that call's input and output, append the tokens in between: tool
    results, the next turn's template). Tokens after the last sampled run were never seen by the policy
    and are left out. A trajectory with no sampled token is one call with an empty output (so the
    execution still counts in its group). `versions`: one per call, or one for all."""
    starts, ends = sampled_runs(sampled)
    n_calls = max(1, starts.shape[0])
    if len(versions) not in (1, n_calls):
        raise RecordError(f"{where}: {len(versions)} weight versions for {n_calls} calls")
    if not starts.shape[0]:
        inp = np.concatenate((prompt, response)).astype(ID_DTYPE, copy=False)
        return [
            Call(
                execution_id=execution_id,
                call_id=f"{call_prefix}0",
                agent_id=agent_id,
                role=role,
                input_ids=inp,
                output_ids=np.zeros(0, ID_DTYPE),
                output_logprobs=np.zeros(0, np.float32),
                weight_version=versions[0],
                finish_reason=last_finish,
            )
        ]
    try:
        out_lps = [as_logprobs(logprobs[a:b]) for a, b in zip(starts, ends, strict=True)]
    except ValueError as exc:
        raise RecordError(f"{where}: `{logprob_field}` of sampled tokens: {exc}") from None
    calls: list[Call] = []
    n_prompt = prompt.shape[0]
    for j, (a, b) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
        common: dict[str, Any] = dict(
            execution_id=execution_id,
            call_id=f"{call_prefix}{j}",
            agent_id=agent_id,
            role=role,
            output_ids=response[a:b],
            output_logprobs=out_lps[j],
            weight_version=versions[j] if len(versions) > 1 else versions[0],
            finish_reason=last_finish if j == n_calls - 1 else "stop",
        )
        if j == 0:
            inp = np.concatenate((prompt, response[:a])).astype(ID_DTYPE, copy=False)
            calls.append(Call(input_ids=inp, **common))
        else:
            prev = int(ends[j - 1])
            delta = Delta(calls[-1].call_id, n_prompt + prev, response[prev:a])
            calls.append(Call(input_delta=delta, **common))
    return calls


class ScoreBook:
    """One `Score` per execution however many rows carry its reward: the first row that does gives it,
    a later one must agree (rows of one execution that disagree on its reward or group are refused)."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[float, str, str]] = {}

    def score(self, execution_id: str, group_id: str, value: float | None, where: str) -> Score | None:
        """The execution's Score when this row is the first to carry its reward, else None."""
        if value is None:
            return None
        seen = self._seen.get(execution_id)
        if seen is None:
            self._seen[execution_id] = (value, group_id, where)
            return Score(execution_id=execution_id, group_id=group_id, value=value)
        for what, now, then in (("reward", value, seen[0]), ("group", group_id, seen[1])):
            if now != then:
                raise RecordError(
                    f"{where}: execution {execution_id!r} has {what} {now!r}, but {seen[2]} gave it {then!r}"
                )
        return None
