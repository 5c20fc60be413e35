"""slime's rollout samples, one JSON object per line as `Sample.to_dict()` gives them, become calls and
scores. A sample's `tokens` are its prompt then its `response_length` response tokens; `loss_mask`
marks the ones the policy sampled (0 for tool output and other inserted text; absent: all sampled),
`rollout_log_probs` holds the engine's logprob of each response token, `reward` the sample's reward.

Samples of one rollout split into several (slime's compact and sub-agent paths) share `rollout_id`:
they become one execution. Execution: `rollout_id`, else `index`; group: `group_index`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from gyre_traj.readers import rows
from gyre_traj.records import Call, RecordError, Score

FINISH = {"completed": "stop", "truncated": "length", "aborted": "abort"}
"""slime's sample status -> the finish reason of the sample's last call (others are kept as they are)."""


def _execution(obj: dict[str, Any], where: str) -> str:
    for key in ("rollout_id", "index"):
        raw = obj.get(key)
        if raw is not None:
            if isinstance(raw, bool) or not isinstance(raw, int | str):
                raise RecordError(f"{where}: `{key}` must be an integer, got {raw!r:.40}")
            return str(raw)
    return where.rsplit(":", 1)[-1]  # neither: the line number


def _versions(obj: dict[str, Any], where: str, n_calls: int) -> list[int]:
    """One version per call when the sample has one per generate call of each turn, else the last (the
    weights that produced its final tokens: partial rollouts resume a sample under newer weights)."""
    raw = obj.get("weight_versions") or []
    if not isinstance(raw, list):
        raise RecordError(f"{where}: `weight_versions` must be a list, got {type(raw).__name__}")
    versions = [rows.version(v, where, f"weight_versions[{k}]") for k, v in enumerate(raw)]
    if not versions:
        return [0]
    return versions if len(versions) == n_calls else [versions[-1]]


def sample_records(
    obj: dict[str, Any], where: str, book: rows.ScoreBook, reward_key: str | None = None
) -> list[Call | Score]:
    """The calls (and, the first time its rollout's reward is seen, the score) of one slime sample."""
    if obj.get("multimodal_train_inputs") or obj.get("multimodal_inputs"):
        raise RecordError(
            f"{where}: a multimodal sample (`multimodal_inputs` set): gyre-traj trains on token ids only"
        )
    if "tokens" not in obj:
        raise RecordError(
            f"{where}: no `tokens` (the sample's prompt + response token ids): a slime sample row needs "
            "`tokens` and `response_length`"
        )
    tokens = rows.ids(obj["tokens"], where, "tokens")
    n_resp = obj.get("response_length", 0)
    if isinstance(n_resp, bool) or not isinstance(n_resp, int) or not 0 <= n_resp <= tokens.shape[0]:
        raise RecordError(
            f"{where}: `response_length` must be an integer in [0, {tokens.shape[0]}] (the length of "
            f"`tokens`), got {n_resp!r:.40}"
        )
    prompt, response = tokens[: tokens.shape[0] - n_resp], tokens[tokens.shape[0] - n_resp :]
    raw_mask = obj.get("loss_mask")
    sampled = (
        np.ones(n_resp, np.bool_) if raw_mask is None else rows.mask(raw_mask, where, "loss_mask", n_resp)
    )
    if obj.get("remove_sample"):  # slime trains none of its tokens (its loss mask becomes all 0)
        sampled = np.zeros(n_resp, np.bool_)
    raw_lps = obj.get("rollout_log_probs")
    if raw_lps is None:
        if sampled.any():
            raise RecordError(
                f"{where}: no `rollout_log_probs` (the engine's logprob of each response token, which the "
                "policy loss needs): slime records them when the engine returns logprobs"
            )
        raw_lps = [0.0] * n_resp
    lps = rows.floats(raw_lps, where, "rollout_log_probs")
    if lps.shape[0] != n_resp:
        raise RecordError(
            f"{where}: {lps.shape[0]} `rollout_log_probs` for `response_length` {n_resp} (must be equal)"
        )
    n_calls = max(1, rows.sampled_runs(sampled)[0].shape[0])
    status = obj.get("status", "completed")
    execution = _execution(obj, where)
    index = obj.get("index")
    calls = rows.trajectory_calls(
        where=where,
        execution_id=execution,
        call_prefix=f"sample{index if index is not None else where.rsplit(':', 1)[-1]}.turn-",
        prompt=prompt,
        response=response,
        sampled=sampled,
        logprobs=lps,
        logprob_field="rollout_log_probs",
        versions=_versions(obj, where, n_calls),
        last_finish=FINISH.get(str(status), str(status)),
    )
    group = obj.get("group_index")
    value = rows.reward(obj.get("reward"), where, "reward", reward_key)
    score = book.score(execution, execution if group is None else str(group), value, where)
    return [*calls, score] if score is not None else list(calls)


def iter_slime(
    lines: Iterable[bytes | str], name: str = "<stream>", *, reward_key: str | None = None
) -> Iterator[Call | Score]:
    """Records of a JSONL file of slime samples (see the module docstring)."""
    book = rows.ScoreBook()
    for where, obj in rows.rows(lines, name):
        yield from sample_records(obj, where, book, reward_key)
