"""verl's rollout dumps (`trainer.rollout_data_dir`: one `<step>.jsonl` per training step, a row per
trajectory with `input`, `output`, `gts`, `score`, `step` and the reward function's extra fields) become
calls and scores, when the rows carry token ids.

verl writes `input` and `output` as text decoded with `skip_special_tokens=True`; the ids the policy
sampled cannot be recovered from it, so a text-only row is refused, naming the fields that would supply
them: `prompt_ids`, `response_ids`, `response_logprobs` and, for multi-turn rows, `response_mask` (the
names of verl's agent-loop output: the response holds the model's tokens and the tool responses, the
mask is 1 on the model's). Execution: `<step>-<k>` for the k-th row of a step; group: `uid` (verl's
group of one prompt's rollouts), else the prompt's token ids, within the step.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from gyre_traj.readers import rows
from gyre_traj.records import Call, RecordError, Score

LOGPROB_FIELDS = ("response_logprobs", "rollout_log_probs")
"""Where a row's behaviour logprobs may be: the agent loop's name, then the training batch's."""


class VerlReader:
    """Turns verl dump rows into records, counting rows per step for execution ids."""

    def __init__(self) -> None:
        self._book = rows.ScoreBook()
        self._per_step: dict[str, int] = {}

    def _missing_ids(self, obj: dict[str, Any], where: str) -> RecordError:
        missing = [f for f in ("prompt_ids", "response_ids") if f not in obj]
        text = [f for f in ("input", "output") if f in obj]
        has = f" (the row has only text: {', '.join(f'`{f}`' for f in text)})" if text else ""
        return RecordError(
            f"{where}: no token ids: {', '.join(f'`{f}`' for f in missing)} missing{has}. verl's dump "
            "decodes the tokens with skip_special_tokens=True, so the sampled ids cannot be recovered "
            "from its text; add to each row `prompt_ids` and `response_ids` (the token ids), "
            "`response_logprobs` (recorded with actor_rollout_ref.rollout.calculate_log_probs=True) and, "
            "for multi-turn rows, `response_mask` (1 on the model's tokens, 0 on tool responses)"
        )

    def records(self, obj: dict[str, Any], where: str) -> list[Call | Score]:
        if "prompt_ids" not in obj or "response_ids" not in obj:
            raise self._missing_ids(obj, where)
        prompt = rows.ids(obj["prompt_ids"], where, "prompt_ids")
        response = rows.ids(obj["response_ids"], where, "response_ids")
        n = response.shape[0]
        raw_mask = obj.get("response_mask")
        sampled = np.ones(n, np.bool_) if raw_mask is None else rows.mask(raw_mask, where, "response_mask", n)
        field = next((f for f in LOGPROB_FIELDS if obj.get(f) is not None), None)
        if field is None:
            raise RecordError(
                f"{where}: no behaviour logprobs (`response_logprobs`: the engine's logprob of each "
                "response token, recorded with actor_rollout_ref.rollout.calculate_log_probs=True)"
            )
        lps = rows.floats(obj[field], where, field)
        if lps.shape[0] != n:
            raise RecordError(f"{where}: {lps.shape[0]} `{field}` for {n} `response_ids` (must be equal)")
        step = obj.get("step", 0)
        if isinstance(step, bool) or not isinstance(step, int | str):
            raise RecordError(f"{where}: `step` must be an integer, got {step!r:.40}")
        k = self._per_step.get(str(step), 0)
        self._per_step[str(step)] = k + 1
        execution = f"{step}-{k}"
        uid = obj.get("uid")
        key = (
            str(uid)
            if uid is not None
            else "p" + hashlib.blake2b(prompt.tobytes(), digest_size=8).hexdigest()
        )
        version = rows.version(obj.get("weight_version", 0), where, "weight_version")
        calls = rows.trajectory_calls(
            where=where,
            execution_id=execution,
            call_prefix="turn-",
            prompt=prompt,
            response=response,
            sampled=sampled,
            logprobs=lps,
            logprob_field=field,
            versions=[version],
            last_finish="stop",
        )
        value = rows.reward(obj.get("score"), where, "score", None)
        score = self._book.score(execution, f"{step}-{key}", value, where)
        return [*calls, score] if score is not None else list(calls)


def iter_verl(lines: Iterable[bytes | str], name: str = "<stream>") -> Iterator[Call | Score]:
    """Records of one verl dump file (see the module docstring)."""
    reader = VerlReader()
    for where, obj in rows.rows(lines, name):
        yield from reader.records(obj, where)
