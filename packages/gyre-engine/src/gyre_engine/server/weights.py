"""Weight updates: named tensors checked against the model, then copied in place all at once.

Every name and shape is checked before any parameter changes, so a bad update leaves the model as it
was. Tensors arrive as safetensors bytes (same-host updates; never pickles) or from a model directory's
`*.safetensors` files. Tied parameters (lm_head tied to the embeddings) accept either name.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load, load_file


class WeightUpdateError(ValueError):
    """An update whose names, shapes or encoding do not fit the model; nothing was changed."""


def decode_safetensors_b64(payloads: list[str]) -> dict[str, torch.Tensor]:
    """Tensors of a list of base64-encoded safetensors files (one per TP rank; gyre-engine has one)."""
    out: dict[str, torch.Tensor] = {}
    for i, payload in enumerate(payloads):
        try:
            out.update(load(base64.b64decode(payload, validate=True)))
        except (binascii.Error, SafetensorError, ValueError) as exc:
            raise WeightUpdateError(
                f"serialized_named_tensors[{i}] is not base64 safetensors: {exc}"
            ) from exc
    return out


def read_model_dir(path: str) -> dict[str, torch.Tensor]:
    """All tensors of the `*.safetensors` files of a model directory; a path that cannot be read (too
    long, unreadable, not safetensors) is a WeightUpdateError (400), like one with no such files."""
    try:
        root = Path(path)
        files = sorted(root.glob("*.safetensors")) if root.is_dir() else []
        if not files:
            raise WeightUpdateError(f"no *.safetensors files in {path!r}")
        out: dict[str, torch.Tensor] = {}
        for f in files:
            out.update(load_file(str(f)))
    except (OSError, SafetensorError) as exc:
        raise WeightUpdateError(f"cannot read the weights in {path[:200]!r}: {exc}") from exc
    return out


def _targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    targets: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    targets.update(dict(model.named_buffers(remove_duplicate=False)))
    return targets


def check_complete(model: torch.nn.Module, names: set[str]) -> None:
    """Raise unless `names` cover every parameter (a tied parameter is covered by any of its names)."""
    covered = {t.data_ptr() for n, t in model.named_parameters(remove_duplicate=False) if n in names}
    missing = [n for n, t in model.named_parameters() if t.data_ptr() not in covered]
    if missing:
        raise WeightUpdateError(
            f"the update lacks {len(missing)} parameters: {missing[:5]}{' ...' if len(missing) > 5 else ''}"
        )


def check_named_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Raise WeightUpdateError unless every name is the model's and every shape matches; copies nothing."""
    if not tensors:
        raise WeightUpdateError("no tensors given")
    targets = _targets(model)
    unknown = [n for n in tensors if n not in targets]
    if unknown:
        raise WeightUpdateError(f"unknown parameter names: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
    for name, t in tensors.items():
        if tuple(t.shape) != tuple(targets[name].shape):
            raise WeightUpdateError(
                f"shape of {name} is {list(t.shape)}, the model's is {list(targets[name].shape)}"
            )
        if t.dtype.is_floating_point != targets[name].dtype.is_floating_point:
            raise WeightUpdateError(f"dtype of {name} is {t.dtype}, the model's is {targets[name].dtype}")


def apply_named_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> int:
    """Copy `tensors` into the model's parameters and buffers; returns how many were copied, once every
    copy has landed. Copies to a GPU are queued without waiting (from page-locked memory they overlap
    each other and this loop), then each GPU's stream is synchronized: the sources may be reused, and
    the update is complete, when this returns."""
    check_named_tensors(model, tensors)
    targets = _targets(model)
    devices: set[torch.device] = set()
    with torch.no_grad():
        for name, t in tensors.items():
            dst = targets[name]
            dst.copy_(t, non_blocking=True)  # casts to the parameter's dtype too
            if dst.device.type == "cuda":
                devices.add(dst.device)
    for d in devices:
        torch.cuda.current_stream(d).synchronize()
    return len(tensors)
