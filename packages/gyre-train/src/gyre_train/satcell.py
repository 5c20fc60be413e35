"""Rank 0's hold on every rank of a satellite cell: pull a snapshot and compute a round, on rank 0's own
`SatelliteRank` and, through the in-cell link, on every other rank at once, with their replies checked.
On a one-rank satellite every operation is rank 0's alone.
"""

from __future__ import annotations

from typing import Any

from gyre_train.cell import Cell
from gyre_train.cellctl import everywhere, merge_metrics
from gyre_train.claimqueue import Assignment
from gyre_train.protocol import Compute, GradShard, Pull, RankReply, RankSetup, RoundItem, Stop
from gyre_train.satrank import SatelliteRank


class SatCell:
    def __init__(self, rank0: SatelliteRank, cell: Cell | None, setup: RankSetup | None) -> None:
        self.rank0 = rank0
        self.cell = cell
        self.link = None if cell is None else cell.leader
        self.world = 1 if cell is None else cell.world
        if self.world > 1:
            assert setup is not None
            self._everywhere(setup, lambda: None)

    def _everywhere(
        self, cmd: Any, local: Any, frames: list[Any] | None = None
    ) -> tuple[Any, list[RankReply]]:
        timeout = self.cell.cfg.reply_timeout_s if self.cell is not None else 0.0
        return everywhere(self.link, cmd, local, timeout, frames or ())

    def pull(self, snapshot: int) -> float:
        """Every rank pulls `snapshot` of its core rank; the slowest rank's seconds."""
        mine, replies = self._everywhere(Pull(snapshot), lambda: self.rank0.pull(snapshot))
        return max([float(mine), *(r.value for r in replies)])

    def compute(self, assignments: list[Assignment]) -> list[tuple[dict[str, float], tuple[GradShard, ...]]]:
        """A round: assignment k computed by data-parallel copy k; per assignment its metrics and, for
        every rank r in order, where rank r's slice is staged."""
        items = [(k, a.index, a.microbatch) for k, a in enumerate(assignments)]
        cmd = Compute(
            assignments[0].batch, tuple(RoundItem(k, a.index, a.specs) for k, a in enumerate(assignments))
        )
        frames = [f for a in assignments for f in a.frames]
        (metrics, shards), replies = self._everywhere(cmd, lambda: self.rank0.compute(items), frames)
        merged = merge_metrics([tuple(metrics), *(r.metrics for r in replies)], len(items))
        per_rank = [shards, *(r.shards for r in replies)]
        return [(merged[k], tuple(rank[k] for rank in per_rank)) for k in range(len(items))]

    def close(self) -> None:
        try:
            if self.world > 1:
                self._everywhere(Stop(), lambda: None)
        finally:
            self.rank0.close()
