"""One rank of a satellite cell: its part of the model (weights only), the subscriber of the matching core
rank's snapshots, and the gradient staging its slices wait in until core rank r has read them.

The `Satellite` (rank 0) owns one and has every other rank's (`follower.py`) do the same work through the
in-cell link; `compute` is collective (model-parallel peers compute together, data-parallel copies
exchange slices), `pull` is per rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from gyre_traj.loss import LossConfig
from gyre_traj.pack import PackedBatch
from gyre_xfer.subscriber import Subscriber, SubscriberConfig
from gyre_xfer.transport import Config as XferConfig
from gyre_xfer.transport import Transport, open_transport

from gyre_train.cell import Cell, shard_plan
from gyre_train.handoff import GradStaging, wire_dtype
from gyre_train.model import Attention, Layout, micro_gradient, params
from gyre_train.protocol import GradShard


class SnapshotMismatchError(RuntimeError):
    """The publisher served another snapshot than the one asked for."""


@dataclass(frozen=True)
class SatWork:
    """How every rank of a satellite computes, pulls and stages (from the core's `Welcome`)."""

    loss: LossConfig
    attention: Attention
    chunk_budget: int
    transport: str
    wire_dtype: str
    bucket_bytes: int
    publisher: str
    """This rank's core publisher (core rank r's, for satellite rank r)."""
    verify_checksums: bool
    token: str = field(default="", repr=False)
    """The run token the publisher answers (this rank's own setting; never sent over the link)."""


class SatelliteRank:
    def __init__(self, model: torch.nn.Module, work: SatWork, cell: Cell | None) -> None:
        self.model = model
        self.work = work
        self.rank = 0 if cell is None else cell.rank
        self.layout = Layout.of(model)
        self.device = next(model.parameters()).device
        self.plan = shard_plan(self.layout.numel, cell)
        self.transport: Transport = open_transport(XferConfig(kind=work.transport))
        self.sub = Subscriber(
            self.transport,
            SubscriberConfig(
                publisher=work.publisher, verify_checksums=work.verify_checksums, token=work.token
            ),
        )
        self.snapshot = -1
        cuda = self.device.type == "cuda"
        ps = params(model)
        # Page-locked staging for snapshot pulls, allocated once: a pull is a memcpy into it plus one
        # asynchronous host-to-device copy per tensor.
        self._staging: dict[str, torch.Tensor] | None = (
            {n: torch.empty(p.shape, dtype=p.dtype, pin_memory=True) for n, p in ps.items()} if cuda else None
        )
        # The gradient staging: a region registered with the transport, in the wire dtype, one slot per
        # micro-batch of a round, read by the matching core rank (page-locked on a GPU).
        self.grad = GradStaging(
            self.transport,
            self.plan.shard_numel,
            work.wire_dtype,
            slots=self.plan.dp,
            bucket_bytes=work.bucket_bytes,
            pin=cuda,
        )
        self._wire = wire_dtype(work.wire_dtype)
        self._local = (
            torch.empty(self.layout.numel, dtype=self._wire, device=self.device) if self.plan.dp > 1 else None
        )

    def pull(self, snapshot: int) -> float:
        """Pull snapshot `snapshot` (-1: the newest) of the matching core rank into the parameters;
        returns the seconds taken."""
        t0 = time.perf_counter()
        ps = params(self.model)
        if self._staging is None:
            snap = self.sub.pull(min_version=max(snapshot, 0), into=ps)  # straight into the parameters
        else:  # accelerator: into page-locked staging (allocated at start), then one copy per tensor
            snap = self.sub.pull(min_version=max(snapshot, 0), into=self._staging)
            with torch.no_grad():
                for n, p in ps.items():
                    p.copy_(self._staging[n], non_blocking=True)
            torch.cuda.synchronize(self.device)
        if snapshot >= 0 and snap.version != snapshot:
            raise SnapshotMismatchError(f"asked for snapshot {snapshot}, the publisher served {snap.version}")
        self.snapshot = snap.version
        return time.perf_counter() - t0

    def compute(
        self, items: list[tuple[int, int, PackedBatch]]
    ) -> tuple[list[dict[str, float]], list[GradShard]]:
        """Compute a round (collective): items (data-parallel index, micro-batch index, micro-batch) in
        index order. Item k's slice of this rank ends in staging slot k; returns per item the metrics
        this rank has ({} if none) and where its slice is staged."""
        w = self.work
        metrics: list[dict[str, float]] = [{} for _ in items]
        out = self.grad.slot(0) if self.plan.dp == 1 else self._local
        assert out is not None
        mine = None
        for k, (dp, _, mb) in enumerate(items):
            if dp == self.plan.index:  # written in the wire dtype: rounded once, here
                mine, metrics[k] = micro_gradient(
                    self.model, self.layout, mb, w.loss, w.attention, out, w.chunk_budget
                )
        if self.plan.dp > 1:
            slots = [torch.empty(self.plan.shard_numel, dtype=self._wire, device=self.device) for _ in items]
            self.plan.exchange([(dp, mine if dp == self.plan.index else None) for dp, _, _ in items], slots)
            for k, s in enumerate(slots):
                self.grad.slot(k).copy_(s)
        return metrics, [self.grad.describe(k, self.rank) for k in range(len(items))]

    def close(self) -> None:
        self.sub.close()
        self.grad.close()
        self.transport.close()
