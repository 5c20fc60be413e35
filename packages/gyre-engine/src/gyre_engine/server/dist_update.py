"""SGLang's distributed weight update on gyre-engine: `/init_weights_update_group`,
`/update_weights_from_distributed` and `/destroy_weights_update_group`.

As in SGLang, the engine joins a weight-update group (`gyre_engine.weight_group`) whose rank 0 is the
trainer, at rank `rank_offset` (gyre-engine has one rank: no tensor parallelism). An update request lists
`names`, `dtypes` and `shapes`; rank 0 then broadcasts each tensor in that order and the engine receives
them. Unlike SGLang, which loads each tensor as it arrives (a failure leaves the model "partially
updated"), gyre-engine receives the whole list into staging buffers first (off the engine thread, so
generation goes on during the transfer) and copies it into the model in one weight update between two
decode steps; so a refused or failed update changes nothing.

Checks: a request whose lists do not line up, name an unknown dtype or a negative dimension, or name
no group, is refused at once (400; no broadcast was consumed, so the trainer must not send). A request
that is well formed but does not fit the model (unknown parameter name, other shape, integer data for a
floating parameter) is received anyway and thrown away, so the collective stays in step and the group
stays usable, then refused (400). A trainer that does not broadcast within the group's timeout: 504, and
the group is closed (it is out of step): init it again.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

import torch

from gyre_engine.protocol import (
    InitWeightsUpdateGroupRequest,
    UpdateFromDistributedRequest,
)
from gyre_engine.weight_group import BACKENDS, WeightGroup, WeightGroupError, WeightGroupTimeout


class DistUpdateError(ValueError):
    """A request that does not fit (bad fields, unknown group, names or shapes the model lacks): 400."""


class GroupBusy(RuntimeError):
    """The group is running another update (409)."""


@dataclass(frozen=True)
class Declared:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dt, torch.dtype):
        raise DistUpdateError(
            f"dtype {name!r} is not a torch dtype name (SGLang's form: 'bfloat16', 'float16', 'float32', ...)"
        )
    return dt


def declared(req: UpdateFromDistributedRequest) -> list[Declared]:
    """The request's tensors, or DistUpdateError when the lists do not line up (nothing is received then)."""
    if not req.names:
        raise DistUpdateError("names is empty")
    if not len(req.names) == len(req.dtypes) == len(req.shapes):
        raise DistUpdateError(
            f"names, dtypes and shapes differ in length ({len(req.names)}, {len(req.dtypes)}, {len(req.shapes)})"
        )
    if len(set(req.names)) != len(req.names):
        raise DistUpdateError("names repeat a tensor")
    if req.load_format not in (None, "direct"):
        raise DistUpdateError(
            f"load_format {req.load_format!r} is not supported by gyre-engine (one broadcast per tensor only)"
        )
    out = []
    for name, dt, shape in zip(req.names, req.dtypes, req.shapes, strict=True):
        if any(d < 0 for d in shape):
            raise DistUpdateError(f"shape of {name} has a negative dimension: {shape}")
        out.append(Declared(name, _dtype(dt), tuple(shape)))
    return out


def misfits(model: torch.nn.Module, tensors: list[Declared]) -> list[str]:
    """What about the declared tensors does not fit the model (empty: all fit)."""
    targets: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    targets.update(dict(model.named_buffers(remove_duplicate=False)))
    problems = []
    for d in tensors:
        t = targets.get(d.name)
        if t is None:
            problems.append(f"unknown parameter name {d.name}")
        elif tuple(t.shape) != d.shape:
            problems.append(f"shape of {d.name} is {list(d.shape)}, the model's is {list(t.shape)}")
        elif d.dtype.is_floating_point != t.dtype.is_floating_point:
            problems.append(f"dtype of {d.name} is {d.dtype}, the model's is {t.dtype}")
    return problems


@dataclass
class _Member:
    group: WeightGroup
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class WeightGroups:
    """The weight-update groups one engine belongs to, by name."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self._groups: dict[str, _Member] = {}
        self._forming: set[str] = set()

    @property
    def names(self) -> list[str]:
        return sorted(self._groups)

    async def init(self, req: InitWeightsUpdateGroupRequest) -> WeightGroup:
        if not req.group_name:
            raise DistUpdateError("group_name must not be empty")
        if req.group_name in self._groups or req.group_name in self._forming:
            raise DistUpdateError(f"weight update group {req.group_name!r} exists; destroy it first")
        if req.backend not in BACKENDS:
            raise DistUpdateError(f"backend {req.backend!r} is not supported; use one of {BACKENDS}")
        if req.backend == "nccl" and self.device.type != "cuda":
            raise DistUpdateError(
                "backend 'nccl' needs the engine on CUDA; this engine runs on the CPU: use 'gloo'"
            )
        if req.world_size < 2 or not 1 <= req.rank_offset < req.world_size:
            raise DistUpdateError(
                f"rank_offset {req.rank_offset} must be in [1, world_size) with world_size >= 2 "
                f"(rank 0 is the trainer); got world_size {req.world_size}"
            )
        if not 0 < req.master_port < 65536:
            raise DistUpdateError(f"master_port {req.master_port} is not a port")
        if not 0 < req.timeout_s <= 86400:
            raise DistUpdateError("timeout_s must be in (0, 86400]")
        self._forming.add(req.group_name)
        try:
            group = await asyncio.to_thread(
                WeightGroup.form,
                req.master_address,
                req.master_port,
                req.rank_offset,  # + tp_rank, which is 0: gyre-engine has one rank
                req.world_size,
                req.group_name,
                req.backend,
                req.timeout_s,
                None,
                self.device,
            )
        finally:
            self._forming.discard(req.group_name)
        self._groups[req.group_name] = _Member(group)
        return group

    def member(self, name: str) -> _Member:
        m = self._groups.get(name)
        if m is None:
            raise DistUpdateError(
                f"no weight update group {name!r} (groups: {self.names}); call /init_weights_update_group first"
            )
        return m

    async def receive(self, req: UpdateFromDistributedRequest) -> dict[str, torch.Tensor]:
        """Receive every tensor of `req` from rank 0, in order; DistUpdateError (after draining the
        broadcasts) when they do not fit the model. Holds the group's lock: one update at a time."""
        m = self.member(req.group_name)
        tensors = declared(req)
        if m.lock.locked():
            raise GroupBusy(f"weight update group {req.group_name!r} is running another update")
        async with m.lock:
            problems = misfits(self.model, tensors)
            whole = sum(p.numel() * p.element_size() for p in self.model.parameters())
            too_big = [d.name for d in tensors if d.nbytes > whole]
            if problems and too_big:  # not even drained: a buffer that large could take the host down
                self._drop(req.group_name)
                raise DistUpdateError(
                    f"refused, nothing changed: {too_big[0]} is declared larger than the whole model "
                    f"({whole} bytes) and was not received; the group {req.group_name!r} is closed "
                    f"(out of step with rank 0): init it again. {'; '.join(problems[:3])}"
                )
            try:
                got = await asyncio.to_thread(_receive_all, m.group, tensors, bool(problems))
            except WeightGroupError:
                self._drop(req.group_name)  # out of step with rank 0 now: unusable
                raise
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise DistUpdateError(
                f"refused, nothing changed (the {len(tensors)} broadcasts were received and dropped): "
                f"{'; '.join(problems[:3])}{more}"
            )
        return got

    def destroy(self, name: str) -> None:
        m = self.member(name)
        if m.lock.locked():
            raise GroupBusy(f"weight update group {name!r} is running an update")
        self._drop(name)

    def _drop(self, name: str) -> None:
        m = self._groups.pop(name, None)
        if m is not None:
            m.group.close()

    def close(self) -> None:
        for name in list(self._groups):
            self._drop(name)


def _receive_all(group: WeightGroup, tensors: list[Declared], drain: bool) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for i, d in enumerate(tensors):
        buf = torch.empty(d.shape, dtype=d.dtype, device=group.device)
        try:
            group.broadcast(buf, f"tensor {i} ({d.name})")
        except WeightGroupTimeout as exc:
            raise WeightGroupTimeout(
                f"{exc}; received {i} of {len(tensors)} tensors, nothing applied; the group is closed "
                "(out of step with rank 0): init it again"
            ) from exc
        except WeightGroupError as exc:
            raise WeightGroupError(
                f"{exc}; received {i} of {len(tensors)} tensors, nothing applied; the group is closed: "
                "init it again"
            ) from exc
        if not drain:
            out[d.name] = buf
    return out
