"""Rank 0's hold on every rank of a core cell: each operation the `Core` needs (compute a round, read a
satellite's gradient, apply, publish, make tensors whole) done on rank 0's own `CoreRank` and, through
the in-cell link, on every other rank at once, with their replies checked.

On a one-rank core every operation is rank 0's alone. Operations of the training thread hold one lock
(so a republish from another thread never interleaves with a step); the server thread's gradient reads
use the link's own channel and may run alongside a computation. What engines load is published by rank
0: its own weights, or, when the model is split (tensor or pipeline parallelism), the whole model
gathered from the ranks onto a second publisher; its versions stay equal to the ranks' snapshots.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

from gyre_xfer.pinning import host_pinning
from gyre_xfer.publisher import Publisher, PublisherConfig

from gyre_train.cell import Cell
from gyre_train.cellctl import LeaderLink, RankFailedError, everywhere, merge_metrics
from gyre_train.claimqueue import Assignment
from gyre_train.corerank import CoreRank
from gyre_train.handoff import BadShardError, HandoffError, ShardTransferError
from gyre_train.protocol import (
    Apply,
    Compute,
    Fetch,
    Gather,
    Gradient,
    LoadWeights,
    Publish,
    RankFailure,
    RankReply,
    RankSetup,
    RoundItem,
    Stop,
    SyncWeights,
)


class CoreCell:
    def __init__(self, rank0: CoreRank, cell: Cell | None, setup: RankSetup | None) -> None:
        self.rank0 = rank0
        self.cell = cell
        self.link: LeaderLink | None = None if cell is None else cell.leader
        self.world = 1 if cell is None else cell.world
        self._lock = threading.Lock()
        self._seq = itertools.count(1)
        self.publishers: tuple[str, ...] = (rank0.publisher.address,)
        if self.link is not None and self.world > 1:
            assert setup is not None
            replies = self._everywhere(setup, lambda: None)[1]
            self.publishers += tuple(r.publisher for r in replies)
        self.engine_publisher = rank0.publisher
        if rank0.megatron:  # rank 0 holds only its part: engines get the whole model from a second publisher
            self.engine_publisher = Publisher(
                rank0.transport,
                PublisherConfig(token=rank0.work.token, pinning=host_pinning(rank0.device)),
            )
        if cell is not None and cell.cfg.dp > 1:
            self.sync_state()

    def _everywhere(
        self, cmd: Any, local: Any, frames: list[Any] | None = None
    ) -> tuple[Any, list[RankReply]]:
        """`cmd` on every other rank and `local()` here, at once (one operation at a time)."""
        timeout = self.cell.cfg.reply_timeout_s if self.cell is not None else 0.0
        with self._lock:
            return everywhere(self.link, cmd, local, timeout, frames or ())

    # ---- training ------------------------------------------------------------------------------------

    def compute(self, batch: int, assignments: list[Assignment]) -> list[dict[str, float]]:
        """A round: assignment k is computed by data-parallel copy k; every rank sums its slices."""
        items = [(k, a.index, a.microbatch) for k, a in enumerate(assignments)]
        cmd = Compute(batch, tuple(RoundItem(k, a.index, a.specs) for k, a in enumerate(assignments)))
        frames = [f for a in assignments for f in a.frames]
        mine, replies = self._everywhere(cmd, lambda: self.rank0.compute(batch, items), frames)
        return merge_metrics([tuple(mine), *(r.metrics for r in replies)], len(items))

    def receive(self, req: Gradient) -> None:
        """The server's gradient sink: every core rank r reads shard r of the satellite's gradient into
        its sum, or, from a one-rank satellite beside a multi-rank core, the one whole gradient and adds
        its own part of it (BadShardError if the shards do not describe this cell's or a whole gradient;
        ShardTransferError if a transfer failed: some ranks may have summed theirs, which a recomputation
        then leaves alone)."""
        ranks = [s.rank for s in req.shards]
        whole = self.world > 1 and ranks == [0]
        if not whole and ranks != list(range(self.world)):
            raise BadShardError(
                f"a gradient for this core needs shards of ranks 0..{self.world - 1} in order (or one whole "
                f"gradient of a one-rank satellite), got {ranks}"
            )
        seq = next(self._seq)
        shard = (lambda r: req.shards[0]) if whole else (lambda r: req.shards[r])
        others = {r: Fetch(req.batch, req.index, shard(r), seq, whole) for r in range(1, self.world)}
        if others:
            assert self.link is not None
            self.link.send_fetch(others)  # type: ignore[arg-type]
        error: HandoffError | None = None
        try:
            self.rank0.fetch(req.batch, req.index, req.shards[0], whole)
        except HandoffError as exc:
            error = exc
        if others:
            assert self.link is not None and self.cell is not None
            replies = self.link.fetch_replies(set(others), seq, self.rank0.work.transfer_timeout_s + 30.0)
            for r in replies:
                if r.failure is RankFailure.BAD_SHARD:
                    error = BadShardError(f"rank {r.rank}: {r.error}")
                elif r.failure is not RankFailure.NONE and not isinstance(error, BadShardError):
                    error = ShardTransferError(f"rank {r.rank}: {r.error}")
        if error is not None:
            raise error

    def apply(self, batch: int, n: int, executions: int) -> float:
        """The AdamW step on every rank; the global gradient norm before clipping."""
        norm, _ = self._everywhere(
            Apply(batch, n, executions), lambda: self.rank0.apply(batch, n, executions)
        )
        return float(norm)

    def publish(self) -> int:
        """Every rank publishes its weights (satellite rank r pulls core rank r's); rank 0 also publishes
        what engines load. Returns the snapshot version, the same for every rank and for engines."""
        version, replies = self._everywhere(Publish(), self.rank0.publish)
        if any(r.version != version for r in replies):
            raise RankFailedError(f"ranks published versions {[version, *(r.version for r in replies)]}")
        if self.engine_publisher is not self.rank0.publisher:
            whole = self.whole_weights()
            assert whole is not None
            engine_version = int(self.engine_publisher.publish(whole))
            if engine_version != version:
                raise RankFailedError(f"engine snapshot {engine_version} != rank snapshot {version}")
        return int(version)

    def whole_weights(self) -> dict[str, Any] | None:
        """The whole model's weights on rank 0 (one-rank names)."""
        params = {n: p.detach() for n, p in self.rank0.model.named_parameters()}
        whole, _ = self._everywhere(Gather("weights"), lambda: self.rank0.whole(params))
        return whole

    def whole_gradient(self, batch: int, n: int) -> dict[str, Any] | None:
        """The summed gradient of step `batch` (not applied) made whole on rank 0."""
        whole, _ = self._everywhere(
            Gather("gradient", batch, n), lambda: self.rank0.whole_gradient(batch, n, 1)
        )
        return whole

    def whole_moment(self, key: str) -> dict[str, Any] | None:
        """AdamW's `key` of every parameter made whole on rank 0 (one-rank names)."""
        whole, _ = self._everywhere(Gather(key), lambda: self.rank0.whole_moment(key))
        return whole

    def load_whole_moment(self, key: str, whole: dict[str, Any], step: float) -> None:
        """Rank 0's whole AdamW `key` (one-rank layout) into every rank's part, step counts set to `step`."""
        self._everywhere(LoadWeights(key, step), lambda: self.rank0.load_whole_moment(key, whole, step))

    def load_whole(self, whole: dict[str, Any]) -> None:
        """Rank 0's whole weights (one-rank layout) into every rank's part."""
        self._everywhere(LoadWeights(), lambda: self.rank0.load_whole(whole))

    def sync_state(self) -> None:
        """Weights and AdamW state of data-parallel copy 0 to every copy."""
        self._everywhere(SyncWeights(), self.rank0.sync_state)

    def close(self) -> None:
        try:
            if self.link is not None and self.world > 1:
                self._everywhere(Stop(), lambda: None)
        finally:
            if self.engine_publisher is not self.rank0.publisher:
                self.engine_publisher.close()
            self.rank0.close()
