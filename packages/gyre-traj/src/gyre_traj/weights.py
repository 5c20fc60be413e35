"""Advantages and loss weights.

Advantages are group-relative: an execution's score minus the mean of the valid scores of its group
(optionally divided by their standard deviation). An evaluation failure is not a score of 0: the
execution leaves training and is counted. Loss weights make the batch loss a token mean inside each
execution, then a mean over executions, so an execution weighs the same however much it branched.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from gyre_traj.records import EvalStatus, Score


@dataclass(frozen=True)
class AdvantageConfig:
    std_normalize: bool = False
    """Divide by the group's standard deviation of valid scores (GRPO); off by default (Dr. GRPO)."""
    eps: float = 1e-6
    """Added to the standard deviation before dividing."""
    min_group_size: int = 2
    """Groups with fewer valid scores than this get no advantage (their executions are skipped)."""


@dataclass
class AdvantageStats:
    groups: int = 0
    scored: int = 0
    eval_failed: int = 0
    timed_out_scored: int = 0
    groups_too_small: int = 0
    zero_signal_groups: int = 0
    """Groups whose valid scores are all equal (every advantage is 0)."""
    failed_executions: list[str] = field(default_factory=list)


def group_advantages(
    scores: Iterable[Score], cfg: AdvantageConfig | None = None
) -> tuple[dict[str, float], AdvantageStats]:
    """Advantage per execution id, for executions with a valid score in a large enough group."""
    cfg = cfg or AdvantageConfig()
    groups: dict[str, list[Score]] = defaultdict(list)
    stats = AdvantageStats()
    seen: set[str] = set()
    for s in scores:
        if s.execution_id in seen:
            raise ValueError(f"score execution={s.execution_id!r}: scored twice")
        seen.add(s.execution_id)
        if s.status is EvalStatus.EVAL_FAILED:
            stats.eval_failed += 1
            stats.failed_executions.append(s.execution_id)
            continue
        groups[s.group_id].append(s)
    out: dict[str, float] = {}
    stats.groups = len(groups)
    for members in groups.values():
        if len(members) < cfg.min_group_size:
            stats.groups_too_small += 1
            continue
        vals = np.array([m.value for m in members], np.float64)
        adv = vals - vals.mean()
        if cfg.std_normalize:
            adv = adv / (vals.std() + cfg.eps)
        if np.all(vals == vals[0]):
            stats.zero_signal_groups += 1
        for m, a in zip(members, adv, strict=True):
            out[m.execution_id] = float(a)
            stats.scored += 1
            stats.timed_out_scored += int(m.timed_out)
    return out, stats


def execution_token_weights(n_loss_tokens: dict[str, int]) -> dict[str, float]:
    """Per-token weight for each execution: 1 / (its loss tokens * number of executions).

    Summed over an execution's loss tokens this is 1 / E for every execution, whatever its branching.
    Executions with no loss token are left out of E.
    """
    live = {e: n for e, n in n_loss_tokens.items() if n > 0}
    if not live:
        return {}
    e_count = len(live)
    return {e: 1.0 / (n * e_count) for e, n in live.items()}
