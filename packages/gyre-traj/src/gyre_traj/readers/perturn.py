"""The common per-turn shape other tools write: one JSON object per model call with `prompt_ids`,
`output_ids` and the output logprobs under one of several usual keys (SGLang's `[logprob, id, text]`
entries included). Each turn becomes a `Call` with its input in full; the tree merges shared prefixes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import msgspec
import numpy as np

from gyre_traj.records import Call, RecordError, Role, as_ids, as_logprobs

_EXEC_KEYS = ("execution_id", "session_id", "trajectory_id", "sample_id", "instance_id", "rollout_id")
_LOGPROB_KEYS = ("output_logprobs", "output_token_logprobs", "rollout_log_probs", "logprobs")
_VERSION_KEYS = ("weight_version", "policy_version", "model_version")


class _ForeignTurn(msgspec.Struct):
    prompt_ids: list[int]
    output_ids: list[int]


def _foreign_logprobs(raw: Any, n: int) -> np.ndarray:
    """The output logprobs of a foreign turn (ValueError, naming what is wrong, for bad ones)."""
    if raw is None:
        raise ValueError(f"no output logprobs (looked for {', '.join(_LOGPROB_KEYS)})")
    if not isinstance(raw, list):
        raise ValueError(f"output logprobs must be a list, got {type(raw).__name__}")
    # SGLang's shape is [[logprob, token_id, text], ...]; others give a flat list of floats.
    vals = [item[0] if isinstance(item, list) and item else item for item in raw]
    if len(vals) != n:
        raise ValueError(f"{len(vals)} output logprobs for {n} output ids (must be equal)")
    return as_logprobs(vals)  # every value checked before its cast to float32


def _foreign_version(obj: dict[str, Any], where: str) -> int:
    """The turn's weight version: an integer, or a string of one (0 when there is none)."""
    key = next((k for k in _VERSION_KEYS if obj.get(k) is not None), None)
    if key is None:
        return 0
    raw = obj[key]
    if isinstance(raw, str) and (digits := raw.strip()).isascii() and digits.isdigit():
        return int(digits)
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    raise RecordError(f"{where}: {key} must be an integer, got {raw!r:.60}")


def iter_foreign(
    lines: Iterable[bytes | str], name: str = "<stream>", default_execution: str = "foreign"
) -> Iterator[Call]:
    """Turns in the common foreign shape (one JSON object per turn: `prompt_ids`, `output_ids`, and
    output logprobs under one of several usual keys) become `Call`s with full inputs. Execution ids come
    from the usual keys, else `default_execution`; call ids are `turn-<n>` within each execution."""
    dec = msgspec.json.Decoder(dict[str, Any])
    counters: dict[str, int] = {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{name}:{lineno}"
        try:
            obj = dec.decode(line)
            turn = msgspec.convert(obj, _ForeignTurn)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise RecordError(f"{where}: {exc}") from None
        execution = next((str(obj[k]) for k in _EXEC_KEYS if obj.get(k) is not None), default_execution)
        index = counters.get(execution, 0)
        counters[execution] = index + 1
        call_id = str(obj.get("call_id", f"turn-{obj.get('turn', index)}"))
        lp = next((obj[k] for k in _LOGPROB_KEYS if obj.get(k) is not None), None)
        role_raw = obj.get("role", "main")
        try:
            role = Role(role_raw)
        except ValueError:
            raise RecordError(
                f"{where}: unknown role {role_raw!r} (one of {[r.value for r in Role]})"
            ) from None
        version = _foreign_version(obj, where)
        try:
            yield Call(
                execution_id=execution,
                call_id=call_id,
                agent_id=str(obj.get("agent_id", "main")),
                role=role,
                input_ids=as_ids(turn.prompt_ids),
                output_ids=as_ids(turn.output_ids),
                output_logprobs=_foreign_logprobs(lp, len(turn.output_ids)),
                weight_version=version,
                finish_reason=str(obj.get("finish_reason", "stop")),
            )
        except (RecordError, ValueError) as exc:
            raise RecordError(f"{where}: {exc}") from None
