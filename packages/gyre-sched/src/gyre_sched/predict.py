"""What the durations seen so far predict about the executions still running.

`DurationModel` keeps a fixed histogram of finished wall durations, split into those that completed and
those cut at the hard timeout, and answers P(an execution of age a ends at the timeout) in O(bins). It is
fed the same records by the simulator and by the service (WaterLevel.finished_*), so both predict alike.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PredictConfig:
    bins: int = 64
    """Histogram bins over [0, timeout]."""
    min_samples: int = 64
    """Finished executions needed before predicting anything (before that, P = 0)."""
    p_timeout: float = 0.7
    """An execution whose P(ends at timeout) is at least this counts as a predicted timeout."""
    timeout_weight: float = 0.25
    """Share of a rollout slot a predicted timeout is counted as. Its end time is the timeout whatever
    service it gets, so a cell can be released while it runs slower; its partial output shrinks."""


class DurationModel:
    """Histogram of finished durations; P(timeout | age) by counting survivors."""

    def __init__(self, timeout_s: float, config: PredictConfig | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.config = config or PredictConfig()
        self.timeout_s = timeout_s
        n = self.config.bins
        self._edges = [timeout_s * i / n for i in range(n + 1)]
        self._completed = [0] * n
        self._timeouts = 0
        self._p_cache: list[float] | None = None

    @property
    def samples(self) -> int:
        return sum(self._completed) + self._timeouts

    def observe(self, duration_s: float, timed_out: bool) -> None:
        self._p_cache = None
        if timed_out or duration_s >= self.timeout_s:
            self._timeouts += 1
            return
        i = min(len(self._completed) - 1, max(0, bisect.bisect_right(self._edges, duration_s) - 1))
        self._completed[i] += 1

    def _table(self) -> list[float]:
        if self._p_cache is None:
            n = len(self._completed)
            p = [0.0] * n
            later = 0  # completed executions with duration in bins >= i
            for i in range(n - 1, -1, -1):
                later += self._completed[i]
                total = later + self._timeouts
                p[i] = self._timeouts / total if total else 0.0
            self._p_cache = p
        return self._p_cache

    def p_timeout(self, age_s: float) -> float:
        """P(ends at the timeout | still running at age `age_s`); 0 until min_samples are seen."""
        if self.samples < self.config.min_samples:
            return 0.0
        if age_s >= self.timeout_s:
            return 1.0
        i = max(0, bisect.bisect_right(self._edges, age_s) - 1)
        return self._table()[i]

    def predicted_timeouts(self, ages: tuple[float, ...], counts: tuple[int, ...]) -> float:
        """How many of the unfinished executions (bucketed by age) are predicted to end at the timeout."""
        thr = self.config.p_timeout
        total = 0.0
        for a, c in zip(ages, counts, strict=True):
            if self.p_timeout(a) >= thr:
                total += c
        return total
