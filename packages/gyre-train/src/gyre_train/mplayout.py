"""Megatron-core tensors between the one-rank layout and a rank's part of it (tensor and pipeline
parallelism): `global_names` maps a stage's local parameter names to the whole model's, `shard_of` cuts a
whole tensor into this rank's tensor-parallel piece, `load_full` loads a whole state dict into this
rank's model, and `gather_full` brings every rank's pieces to the cell's rank 0 as whole tensors (the
weights engines load, a gradient to compare). `part_of_whole` cuts a one-rank model's flat gradient (a
one-rank satellite's) into this rank's flat gradient, its layout order.

Tensor-parallel pieces follow Megatron's partition attributes (`tensor_model_parallel`,
`partition_dim`): the fused QKV rows are grouped per query group, so a rank's groups are one contiguous
run; the fused SwiGLU `linear_fc1` holds [gate; up] whole and [gate_r; up_r] on rank r, so it is cut and
joined per half. Pipeline stages number their layers from 0; `decoder.layers.i` on a stage is the whole
model's layer `layer_number - 1`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import msgspec
import torch
from megatron.core import parallel_state

from gyre_train.layoutdigest import layout_digest

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def global_names(model: Any) -> dict[str, str]:
    """This rank's parameter names -> the whole model's names (layers renumbered across stages)."""
    number = {i: int(layer.layer_number) - 1 for i, layer in enumerate(model.decoder.layers)}
    out = {}
    for name, _ in model.named_parameters():
        m = _LAYER.match(name)
        out[name] = name if m is None else f"decoder.layers.{number[int(m.group(1))]}.{name[m.end() :]}"
    return out


def _is_swiglu(name: str, model: Any) -> bool:
    return name.endswith("mlp.linear_fc1.weight") and bool(model.config.gated_linear_unit)


def partial_over_tp(name: str) -> bool:
    """A parameter every tensor-parallel rank holds whole but whose gradient each rank has only in part,
    summed over the group when the step's gradient is final (the q/k layer norms: each rank sees only its
    heads)."""
    return "q_layernorm" in name or "k_layernorm" in name


def _partition_dim(param: Any) -> int:
    """The dimension Megatron split `param` along (its `partition_dim` attribute)."""
    return int(param.partition_dim)


def shard_of(full: torch.Tensor, param: torch.Tensor, swiglu: bool) -> torch.Tensor:
    """This tensor-parallel rank's piece of the whole tensor `full` for parameter `param`."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    tp = parallel_state.get_tensor_model_parallel_world_size()
    r = parallel_state.get_tensor_model_parallel_rank()
    dim = _partition_dim(param)
    if swiglu:
        gate, up = full.chunk(2, dim=dim)
        return torch.cat([gate.chunk(tp, dim=dim)[r], up.chunk(tp, dim=dim)[r]], dim=dim)
    return full.chunk(tp, dim=dim)[r]


def load_full(model: Any, full: Mapping[str, Any]) -> None:
    """Copy this rank's part of the whole-model state dict `full` (one-rank Megatron names) into `model`."""
    names = global_names(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            t = torch.as_tensor(full[names[name]])
            p.copy_(shard_of(t, p, _is_swiglu(name, model)).reshape(p.shape))


def _whole_shape(param: torch.Tensor) -> tuple[int, ...]:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[_partition_dim(param)] *= parallel_state.get_tensor_model_parallel_world_size()
    return tuple(shape)


def whole_numel(model: Any) -> int:
    """Elements of the one-rank model's flat gradient (its `Layout` numel), from this rank's part; a model
    of one pipeline stage only (ValueError otherwise: a stage does not know the other stages' sizes)."""
    if parallel_state.get_pipeline_model_parallel_world_size() != 1:
        raise ValueError("a one-rank gradient is cut only for a model of one pipeline stage")
    return sum(math.prod(_whole_shape(p)) for p in model.parameters())


def part_of_whole(model: Any, whole: torch.Tensor) -> torch.Tensor:
    """This rank's flat gradient (its parameters in order) cut from `whole`, a one-rank model's flat
    gradient (the same parameters in the same order, whole; one pipeline stage). A tensor-parallel
    parameter takes its shard (`shard_of`); one every rank holds whole takes it whole, except a gradient
    summed over the group when final (`partial_over_tp`): tensor-parallel rank 0 takes it whole, the
    others zeros, so the sum counts it once. Copies `whole`'s elements (dtype kept), rounds nothing."""
    n = whole_numel(model)
    if tuple(whole.shape) != (n,):
        raise ValueError(f"a one-rank gradient of this model has ({n},) elements, got {tuple(whole.shape)}")
    r = parallel_state.get_tensor_model_parallel_rank()
    parts = []
    off = 0
    for name, p in model.named_parameters():
        shape = _whole_shape(p)
        full = whole[off : off + math.prod(shape)].view(shape)
        off += full.numel()
        if partial_over_tp(name) and r != 0:
            parts.append(torch.zeros(p.numel(), dtype=whole.dtype, device=whole.device))
        else:
            parts.append(shard_of(full, p, _is_swiglu(name, model)).reshape(-1))
    return torch.cat(parts)


def _join(pieces: list[torch.Tensor], param: torch.Tensor, swiglu: bool) -> torch.Tensor:
    dim = _partition_dim(param)
    if swiglu:
        halves = [p.chunk(2, dim=dim) for p in pieces]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
    return torch.cat(pieces, dim=dim)


def _tp_whole(model: Any, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor of this stage made whole over the tensor-parallel group (all ranks of it call this)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group()
    params = dict(model.named_parameters())
    names = global_names(model)
    out = {}
    for name, t in tensors.items():
        p = params[name]
        if tp > 1 and getattr(p, "tensor_model_parallel", False):
            pieces = [torch.empty_like(t) for _ in range(tp)]
            torch.distributed.all_gather(pieces, t.contiguous(), group=group)
            t = _join(pieces, p, _is_swiglu(name, model))
        out[names[name]] = t.detach().cpu()
    return out


class _Header(msgspec.Struct, frozen=True, array_like=True):
    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]


def _send_bytes(payload: bytes, dst: int) -> None:
    torch.distributed.send(torch.tensor([len(payload)], dtype=torch.int64), dst)
    torch.distributed.send(torch.frombuffer(bytearray(payload), dtype=torch.uint8), dst)


def _recv_bytes(src: int) -> bytes:
    n = torch.zeros(1, dtype=torch.int64)
    torch.distributed.recv(n, src)
    buf = torch.empty(int(n.item()), dtype=torch.uint8)
    torch.distributed.recv(buf, src)
    return bytes(buf.numpy())


def broadcast_full(model: Any, full: Mapping[str, torch.Tensor] | None) -> None:
    """Rank 0's whole state dict `full` (one-rank names; None elsewhere) loaded into every rank's part
    (every rank of the cell calls it; the tensors travel once each, over the CPU)."""
    load_full(model, broadcast_tensors(full))


def shards_of(model: Any, full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's part of every whole tensor of `full` (one-rank names; every parameter's), by this
    rank's parameter names, shaped as its parameters (an AdamW moment cut as its parameter is)."""
    names = global_names(model)
    return {
        name: shard_of(torch.as_tensor(full[names[name]]), p, _is_swiglu(name, model)).reshape(p.shape)
        for name, p in model.named_parameters()
    }


def whole_digest(model: Any) -> str:
    """The `Layout` digest of the one-rank model this rank holds a part of (names, whole shapes, dtypes in
    order; one pipeline stage)."""
    if parallel_state.get_pipeline_model_parallel_world_size() != 1:
        raise ValueError("the one-rank layout is known from a part only for a model of one pipeline stage")
    return layout_digest((n, _whole_shape(p), p.dtype) for n, p in model.named_parameters())


def broadcast_tensors(full: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """Rank 0's tensors `full` (None elsewhere) on every rank of the cell (every rank calls it; each
    tensor travels once, over the CPU)."""
    if torch.distributed.get_rank() == 0:
        assert full is not None
        names = tuple(full)
        head = _Header(
            names, tuple(_dtype_name(full[n]) for n in names), tuple(tuple(full[n].shape) for n in names)
        )
        payload = msgspec.msgpack.encode(head)
        n = torch.tensor([len(payload)], dtype=torch.int64)
        torch.distributed.broadcast(n, 0)
        torch.distributed.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), 0)
    else:
        n = torch.zeros(1, dtype=torch.int64)
        torch.distributed.broadcast(n, 0)
        buf = torch.empty(int(n.item()), dtype=torch.uint8)
        torch.distributed.broadcast(buf, 0)
        head = msgspec.msgpack.decode(bytes(buf.numpy()), type=_Header)
    tensors = {}
    for name, dt, shape in zip(head.names, head.dtypes, head.shapes, strict=True):
        t = (
            full[name].detach().cpu().contiguous()
            if full is not None
            else torch.empty(shape, dtype=_dtype(dt))
        )
        torch.distributed.broadcast(t, 0)
        tensors[name] = t
    return tensors


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def gather_full(model: Any, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """Whole tensors (one-rank names) on the cell's rank 0, None on every other rank; every rank of the
    cell calls it with its own tensors by local parameter name (its parameters, or their gradients).
    Ranks of data-parallel index > 0 hold copies and only take part in nothing."""
    if parallel_state.get_data_parallel_rank() != 0:
        return None
    whole = _tp_whole(model, tensors)
    if parallel_state.get_tensor_model_parallel_rank() != 0:
        return None
    stages = torch.distributed.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    me = torch.distributed.get_rank()
    if me != stages[0]:  # a later stage: send this stage's tensors to the cell's rank 0 (on the CPU)
        names = tuple(whole)
        head = _Header(
            names, tuple(_dtype_name(whole[n]) for n in names), tuple(tuple(whole[n].shape) for n in names)
        )
        _send_bytes(msgspec.msgpack.encode(head), stages[0])
        for n in names:
            torch.distributed.send(whole[n].contiguous(), stages[0])
        return None
    out = dict(whole)
    for src in stages[1:]:
        head = msgspec.msgpack.decode(_recv_bytes(src), type=_Header)
        for n, dt, shape in zip(head.names, head.dtypes, head.shapes, strict=True):
            t = torch.empty(shape, dtype=_dtype(dt))
            torch.distributed.recv(t, src)
            out[n] = t
    return out
