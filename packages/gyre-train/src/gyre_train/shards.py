"""Which part of a micro-batch gradient each rank of a cell sums and hands over.

A rank's model part has a flat gradient of `numel` elements (its tensor-parallel shards of its pipeline
stage; the whole model without model parallelism). Its data-parallel group of `dp` copies splits that
vector into `dp` equal slices (the last padded with zeros): copy i owns slice i. In a round, each copy
computes one micro-batch; `exchange` then hands slice i of every micro-batch's gradient to copy i, one
`torch.distributed.scatter` per micro-batch in index order (as raw bytes of the wire dtype, so the bits
are untouched). So every rank of a core and of a satellite ends up with the same slice of every gradient,
and satellite rank r hands its slice to core rank r. `own` is this rank's slice of a whole vector it holds (a one-rank satellite's gradient). `gather` rebuilds the whole vector from the slices
(an all-gather) before the optimizer step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ShardPlan:
    numel: int
    """Flat gradient length of this rank's model part."""
    dp: int = 1
    index: int = 0
    """This rank's data-parallel index."""
    group: Any = None
    """The data-parallel group (None: the default group)."""
    ranks: tuple[int, ...] = (0,)
    """Global ranks of the data-parallel group, by data-parallel index."""

    @property
    def shard_numel(self) -> int:
        return -(-self.numel // self.dp)

    def padded(self, flat: torch.Tensor) -> torch.Tensor:
        """`flat` padded with zeros to `dp` whole slices (itself when no padding is needed)."""
        pad = self.shard_numel * self.dp - self.numel
        return flat if pad == 0 else torch.cat([flat, flat.new_zeros(pad)])

    def own(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the whole flat vector `flat` (a view of it, or of its padded copy)."""
        return self.padded(flat).view(self.dp, -1)[self.index]

    def exchange(
        self, computed: Sequence[tuple[int, torch.Tensor | None]], out: Sequence[torch.Tensor]
    ) -> None:
        """For each (source data-parallel index, its flat gradient or None elsewhere) in order, copy this
        rank's slice of the source's gradient into the matching tensor of `out` (all ranks of the group
        call this with the same sources in the same order)."""
        for (src, grad), dst in zip(computed, out, strict=True):
            if self.dp == 1:
                assert grad is not None
                if grad.data_ptr() != dst.data_ptr():
                    dst.copy_(grad)
                continue
            parts = None
            if src == self.index:
                assert grad is not None
                parts = list(_bytes(self.padded(grad)).view(self.dp, -1).unbind(0))
            recv = torch.empty(self.shard_numel * dst.element_size(), dtype=torch.uint8, device=dst.device)
            torch.distributed.scatter(recv, parts, src=self.ranks[src], group=self.group)
            dst.copy_(recv.view(dst.dtype))

    def gather(self, shard: torch.Tensor) -> torch.Tensor:
        """The whole flat vector from every copy's slice (all ranks of the group call this)."""
        if self.dp == 1:
            return shard
        pieces = [torch.empty_like(shard) for _ in range(self.dp)]
        torch.distributed.all_gather(pieces, shard.contiguous(), group=self.group)
        return torch.cat(pieces)[: self.numel]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)
