"""Fused projections: the q/k/v projections of each attention layer and the gate/up projections of each
MLP run as one GEMM over one weight, while the model keeps its modules, parameter names and forward.

At decode batch sizes a GEMM reads its weight once and computes little, so seven narrow GEMMs per layer
cost far more than the bytes they read: on the H200 (`bench/kernels_b64.py`, 64 rows, 28 Qwen3-0.6B
layers) the seven took 1.07 ms and the four of the fused layout 0.72 ms for the same 0.88 GB.

How: the members' weights (and biases) are copied once into one tensor per group, and each member's
`weight` becomes a `Parameter` that is a view of its rows. The members become `FusedLinear` (an
`nn.Linear` whose forward asks its group): the first member called with an input computes the group's
GEMM, and each member returns its columns of that output; the group forgets the output once every member
has taken its part, and recomputes whenever it is called with another input. Names, shapes and
`state_dict` are unchanged, and a weight update that copies into the parameters (all of gyre-engine's
do) writes into the fused weight. Moving the parameters (`model.to`, release/resume of weights) breaks
the views: `refresh()` rebuilds the groups, and `drop()` lets the fused copies go.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Sibling linear layers fused when a module has all of them (the transformers names of Llama-style
attention and gated MLPs); the model's forward must call each once per input, as these do."""


class FusedLinear(nn.Linear):
    """A member of a `_Group`: its output is its slice of the group's GEMM."""

    _gyre_group: _Group
    _gyre_cols: tuple[int, int]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._gyre_group.output(x, self)


class _Group:
    def __init__(self, members: list[Any]) -> None:
        self.members = members
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.x: torch.Tensor | None = None
        self.y: torch.Tensor | None = None
        self.left = 0
        self.build()

    @torch.no_grad()
    def build(self) -> None:
        ms = self.members
        self.weight = torch.cat([m.weight.detach() for m in ms])
        self.bias = torch.cat([m.bias.detach() for m in ms]) if ms[0].bias is not None else None
        lo = 0
        for m in ms:
            hi = lo + m.out_features
            m.weight = nn.Parameter(self.weight[lo:hi], requires_grad=m.weight.requires_grad)
            if self.bias is not None:
                m.bias = nn.Parameter(self.bias[lo:hi], requires_grad=m.bias.requires_grad)
            m.__class__ = FusedLinear
            setattr(m, "_gyre_cols", (lo, hi))  # noqa: B010  (plain attributes, not submodules)
            setattr(m, "_gyre_group", self)  # noqa: B010
            lo = hi
        self.x = self.y = None

    def intact(self) -> bool:
        """Whether every member's parameters are still the views into the fused tensors."""
        if self.weight is None:
            return False
        row = self.weight.stride(0) * self.weight.element_size()
        for m in self.members:
            lo, _ = m._gyre_cols
            if (
                m.weight.device != self.weight.device
                or m.weight.data_ptr() != self.weight.data_ptr() + lo * row
            ):
                return False
            if (
                self.bias is not None
                and m.bias.data_ptr() != self.bias.data_ptr() + lo * self.bias.element_size()
            ):
                return False
        return True

    def output(self, x: torch.Tensor, member: FusedLinear) -> torch.Tensor:
        if self.y is None or self.x is not x:
            assert self.weight is not None, "fused weights were dropped (released); refresh() first"
            self.y = F.linear(x, self.weight, self.bias)
            self.x = x
            self.left = len(self.members)
        lo, hi = member._gyre_cols
        out = self.y[..., lo:hi]
        self.left -= 1
        if self.left == 0:
            self.x = self.y = None
        return out


class FusedProjections:
    """The fused groups of one model (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.groups: list[_Group] = []
        for mod in model.modules():
            for names in GROUPS:
                ms = [getattr(mod, n, None) for n in names]
                if all(_fusable(m) for m in ms) and _compatible(ms):
                    self.groups.append(_Group(ms))
        log.info("fused %d projection groups", len(self.groups))

    def __len__(self) -> int:
        return len(self.groups)

    def tensors(self) -> list[torch.Tensor]:
        """The groups' fused weights and biases (the members' parameters are views of them)."""
        out: list[torch.Tensor] = []
        for g in self.groups:
            out.extend(t for t in (g.weight, g.bias) if t is not None)
        return out

    def refresh(self) -> int:
        """Rebuild every group whose parameters moved (after `model.to`); returns how many."""
        n = 0
        for g in self.groups:
            if not g.intact():
                g.build()
                n += 1
        return n

    def drop(self) -> None:
        """Forget the fused tensors (after the parameters moved away, e.g. to the host on release)."""
        for g in self.groups:
            g.weight = g.bias = g.x = g.y = None


def _fusable(m: Any) -> bool:
    return type(m) is nn.Linear


def _compatible(ms: list[Any]) -> bool:
    first = ms[0]
    return all(
        m.in_features == first.in_features
        and (m.bias is None) == (first.bias is None)
        and m.weight.dtype == first.weight.dtype
        and m.weight.device == first.weight.device
        for m in ms
    )
