"""One rank of a core cell: its part of the model and of AdamW, its shard of the step's gradient sum, the
landing region satellites' shards are read into (a one-rank satellite's whole gradient: a second
one, of whose elements the rank adds its own part), and the publisher of its weights.

The `Core` (rank 0) owns one and has every other rank's (`follower.py`) do the same work through the
in-cell link; a method marked *collective* is called on every rank of the cell in the same order. On a
one-rank core there is nothing to exchange and every collective is local.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from gyre_traj.loss import LossConfig
from gyre_traj.pack import PackedBatch
from gyre_xfer.pinning import host_pinning
from gyre_xfer.publisher import Publisher, PublisherConfig
from gyre_xfer.transport import Config as XferConfig
from gyre_xfer.transport import Transport, open_transport

from gyre_train.cell import Cell, shard_plan
from gyre_train.defaults import CHUNK_MEMORY
from gyre_train.handoff import GradReader, wire_dtype
from gyre_train.model import Attention, ChunkMemory, Layout, micro_gradient, params, set_gradients
from gyre_train.protocol import GradShard
from gyre_train.shardsum import ShardSum

MOMENTS = ("exp_avg", "exp_avg_sq")
"""AdamW's per-parameter tensors, each shaped (and split over ranks) as its parameter."""


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    """Clip the summed gradient to this global norm (0 = no clipping)."""


@dataclass(frozen=True)
class RankWork:
    """How every rank of a core computes and hands over gradients (the core's configuration)."""

    loss: LossConfig
    attention: Attention
    chunk_budget: int
    transport: str
    wire_dtype: str
    transfer_timeout_s: float
    optim: OptimConfig
    token: str = field(default="", repr=False)
    """The run token for the weight publisher (never sent to other ranks: each has its own setting)."""
    chunk_memory: ChunkMemory = CHUNK_MEMORY
    """`CoreConfig.chunk_memory` (the core's rank; other ranks of a cell and satellites use the default)."""


class CoreRank:
    def __init__(self, model: torch.nn.Module, work: RankWork, cell: Cell | None) -> None:
        self.model = model
        self.work = work
        self.cell = cell
        self.layout = Layout.of(model)
        self.device = next(model.parameters()).device
        self.plan = shard_plan(self.layout.numel, cell)
        o = work.optim
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
        )
        self.transport: Transport = open_transport(XferConfig(kind=work.transport))
        self.publisher = Publisher(
            self.transport, PublisherConfig(token=work.token, pinning=host_pinning(self.device))
        )
        wire = wire_dtype(work.wire_dtype)
        self.wire = wire
        self.sum = ShardSum(self.plan.shard_numel, self.device, wire)
        cuda = self.device.type == "cuda"
        self.reader = GradReader(self.transport, self.plan.shard_numel, work.wire_dtype, pin=cuda)
        self._whole_reader: GradReader | None = None
        """The landing region of a one-rank satellite's whole gradient (allocated at its first)."""
        self._scratch = torch.empty(self.layout.numel, dtype=torch.float32, device=self.device)

    @property
    def megatron(self) -> bool:
        return self.cell is not None and self.cell.megatron

    # ---- a round of micro-batches (collective) -------------------------------------------------------

    def compute(self, batch: int, items: list[tuple[int, int, PackedBatch]]) -> list[dict[str, float]]:
        """Items (data-parallel index, micro-batch index, micro-batch), in index order: compute this
        rank's (with its model-parallel peers), hand every item's slice to its owner, and add this
        rank's slices into the sum. Returns per item the metrics this rank has ({} if it has none)."""
        w = self.work
        metrics: list[dict[str, float]] = [{} for _ in items]
        mine: torch.Tensor | None = None
        for k, (dp, _, mb) in enumerate(items):
            if dp == self.plan.index:
                mine, metrics[k] = micro_gradient(
                    self.model,
                    self.layout,
                    mb,
                    w.loss,
                    w.attention,
                    self._scratch,
                    w.chunk_budget,
                    w.chunk_memory,
                )
        if self.plan.dp == 1:
            ((_, index, _),) = items
            assert mine is not None
            self.sum.add(batch, index, mine)  # rounded to the wire dtype inside, copied into the sum
            return metrics
        rounded = None if mine is None else mine.to(self.wire)  # the one rounding, where it is computed
        outs = [torch.empty(self.plan.shard_numel, dtype=self.wire, device=self.device) for _ in items]
        self.plan.exchange([(dp, rounded if dp == self.plan.index else None) for dp, _, _ in items], outs)
        for (_, index, _), out in zip(items, outs, strict=True):
            self.sum.add(batch, index, out)
        return metrics

    # ---- a satellite's shard (the server thread on rank 0, the fetch thread elsewhere) ---------------

    def fetch(self, batch: int, index: int, shard: GradShard, whole: bool = False) -> None:
        """Read this rank's shard of a satellite's gradient and add it into the sum. `whole`: the shard is
        a one-rank satellite's whole gradient (the one-rank layout); this rank reads all of it and adds
        its own part (`part_of_whole`: the same split as its parameters, then its data-parallel slice)."""
        if not whole:
            self.sum.add(batch, index, self.reader.read(shard, self.work.transfer_timeout_s))
            return
        if self._whole_reader is None:
            cuda = self.device.type == "cuda"
            self._whole_reader = GradReader(self.transport, self.whole_numel, self.work.wire_dtype, pin=cuda)
        flat = self._whole_reader.read(shard, self.work.transfer_timeout_s)
        self.sum.add(batch, index, self.plan.own(self.part_of_whole(flat)))

    @property
    def whole_numel(self) -> int:
        """Elements of the one-rank model's flat gradient (a one-rank satellite's)."""
        if self.megatron:
            from gyre_train import mplayout

            return mplayout.whole_numel(self.model)
        return self.layout.numel

    def part_of_whole(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's flat gradient (its model part, before the data-parallel slice) cut from a one-rank
        model's flat gradient."""
        if self.megatron:
            from gyre_train import mplayout

            return mplayout.part_of_whole(self.model, flat)
        return flat

    # ---- the update (collective) ---------------------------------------------------------------------

    def gradient(self, batch: int, n: int, executions: int) -> torch.Tensor:
        """The step's whole flat gradient of this rank's model part: the in-order sums of every
        data-parallel slice, divided by `executions`, gathered (collective)."""
        shard = self.sum.total(batch, n)
        assert shard is not None
        if executions != 1:
            shard = shard / executions  # float32, once, after the in-order sum
        return self.plan.gather(shard)

    def set_grads(self, flat: torch.Tensor) -> None:
        set_gradients(self.model, self.layout, flat)
        if self.megatron:
            from gyre_train import megatron

            megatron.finalize_grads(self.model)

    def apply(self, batch: int, n: int, executions: int) -> float:
        """Step AdamW on the step's gradient; returns the global gradient norm before clipping."""
        flat = self.gradient(batch, n, executions)
        self.set_grads(flat)
        mx = self.work.optim.max_grad_norm
        if self.megatron:
            norm = self._model_parallel_clip(mx)
        else:
            norm = float(torch.linalg.vector_norm(flat, dtype=torch.float64))
            if mx > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), mx)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def _model_parallel_clip(self, max_norm: float) -> float:
        """The norm over the whole model (each tensor-parallel duplicate counted once, summed over the
        model-parallel group in float64), and torch's clipping rule with it."""
        from megatron.core import parallel_state

        from gyre_train import megatron

        sq = megatron.grad_norm_sq(self.model)
        torch.distributed.all_reduce(sq, group=parallel_state.get_model_parallel_group())
        norm = math.sqrt(float(sq))
        if max_norm > 0:
            coef = min(1.0, max_norm / (norm + 1e-6))
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(torch.tensor(coef, dtype=torch.float32, device=p.grad.device))
        return norm

    def publish(self) -> int:
        """Publish this rank's weights as its next gyre-xfer snapshot; returns its version."""
        return int(self.publisher.publish(params(self.model)))

    def sync_state(self) -> None:
        """Weights and AdamW state of data-parallel copy 0 to every copy (collective)."""
        p = self.plan
        if p.dp == 1:
            return
        src = p.ranks[0]
        with torch.no_grad():
            for param in self.model.parameters():
                torch.distributed.broadcast(param.data, src, group=p.group)
                st = self.optimizer.state[param]
                has = torch.tensor([1 if st else 0], dtype=torch.int64)
                torch.distributed.broadcast(has, src, group=p.group)
                if not int(has.item()):
                    st.clear()
                    continue
                if not st:
                    st.update(
                        step=torch.zeros(()),
                        exp_avg=torch.zeros_like(param),
                        exp_avg_sq=torch.zeros_like(param),
                    )
                for key in ("step", "exp_avg", "exp_avg_sq"):
                    torch.distributed.broadcast(st[key], src, group=p.group)

    def whole(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """`tensors` (by this rank's parameter names) made whole on rank 0 (collective): gathered from
        the model-parallel ranks with Megatron; as they are without model parallelism."""
        if self.megatron:
            from gyre_train import mplayout

            return mplayout.gather_full(self.model, tensors)
        return tensors if self.cell is None or self.cell.rank == 0 else None

    def load_whole(self, whole: dict[str, torch.Tensor] | None) -> None:
        """Take this rank's part of rank 0's whole weights (`whole` on rank 0, None elsewhere; collective)."""
        if self.megatron:
            from gyre_train import mplayout

            mplayout.broadcast_full(self.model, whole)
            return
        if whole is not None:
            from gyre_train.model import load_params

            load_params(self.model, whole)
        self.sync_state()

    def whole_moment(self, key: str) -> dict[str, torch.Tensor] | None:
        """AdamW's `key` ("exp_avg" or "exp_avg_sq") of every parameter made whole on rank 0, one-rank
        names (collective; {} before the first update, when AdamW holds none)."""
        if key not in MOMENTS:
            raise ValueError(f"AdamW moment {key!r} is not one of {MOMENTS}")
        ps = dict(self.model.named_parameters())
        return self.whole({n: st[key] for n, p in ps.items() if (st := self.optimizer.state.get(p))})

    def load_whole_moment(self, key: str, whole: dict[str, torch.Tensor] | None, step: float) -> None:
        """Take this rank's part of rank 0's whole AdamW `key` (`whole` on rank 0, None elsewhere; every
        parameter's) and set every parameter's AdamW step count to `step` (collective, Megatron only)."""
        from gyre_train import mplayout

        if key not in MOMENTS:
            raise ValueError(f"AdamW moment {key!r} is not one of {MOMENTS}")
        mine = mplayout.shards_of(self.model, mplayout.broadcast_tensors(whole))
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                st = self.optimizer.state[p]
                if not st:
                    st.update(
                        step=torch.zeros(()), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p)
                    )
                st[key].copy_(mine[name])
                st["step"].fill_(step)

    def whole_gradient(self, batch: int, n: int, executions: int) -> dict[str, torch.Tensor] | None:
        """The step's summed gradient made whole on rank 0, without applying it (collective)."""
        self.set_grads(self.gradient(batch, n, executions))
        out = self.whole({k: v.grad for k, v in self.model.named_parameters() if v.grad is not None})
        self.optimizer.zero_grad(set_to_none=True)
        return out

    def close(self) -> None:
        if self._whole_reader is not None:
            self._whole_reader.close()
        self.reader.close()
        self.publisher.close()
        self.transport.close()
