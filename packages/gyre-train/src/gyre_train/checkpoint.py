"""Checkpoints: a trainer's state dict (`Core.state_dict()`) to a directory and back, so a resumed core
gives the same next update as one that never stopped.

The state dict this module writes and reads (`TrainerState`): `model` (parameters by name), `optimizer`
(`{"state": {param: {key: tensor}}, "param_groups": [hyper-parameters]}`, by parameter name), `position`
(step, version, queue_position), `layout` (the parameter layout's digest) and `model_config` (`ModelConfig.to_dict`). On disk:
`model.safetensors`, `optimizer.safetensors` (`<param>::exp_avg`, `<param>::exp_avg_sq`,
`<param>::step`) and `state.json` (the rest). Written to a temporary directory and renamed into place, so
a crash leaves the previous checkpoint whole. No pickle anywhere. This module knows nothing of the core:
the core builds and loads the state dict, and checks it matches its model.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, TypedDict

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

FORMAT = 1


class CheckpointError(ValueError):
    """A checkpoint that does not match the model it is loaded into, or is incomplete."""


class OptimizerState(TypedDict):
    state: dict[str, dict[str, torch.Tensor]]
    """Per parameter name, its optimizer tensors (AdamW: exp_avg, exp_avg_sq, step)."""
    param_groups: list[dict[str, Any]]
    """Hyper-parameters of each parameter group (without the parameters)."""


class TrainerState(TypedDict):
    model: dict[str, torch.Tensor]
    optimizer: OptimizerState
    position: dict[str, int]
    """step, version, queue_position."""
    layout: str
    model_config: dict[str, Any]


def save(state: TrainerState, path: Path) -> Path:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(
        {n: t.detach().cpu().contiguous() for n, t in state["model"].items()}, str(tmp / "model.safetensors")
    )
    opt = {
        f"{n}::{k}": torch.as_tensor(v).detach().cpu().contiguous()
        for n, st in state["optimizer"]["state"].items()
        for k, v in st.items()
    }
    save_file(opt, str(tmp / "optimizer.safetensors"))
    meta = {
        "format": FORMAT,
        **{k: int(state["position"][k]) for k in ("step", "version", "queue_position")},
        "layout": state["layout"],
        "model": state["model_config"],
        "param_groups": state["optimizer"]["param_groups"],
    }
    (tmp / "state.json").write_text(json.dumps(meta, indent=1, default=list) + "\n")
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    old = path.with_name(path.name + ".old")
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)
    return path


def load(path: Path) -> TrainerState:
    path = Path(path)
    try:
        meta = json.loads((path / "state.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: no readable state.json ({exc})") from exc
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {meta.get('format')}, expected {FORMAT}")
    try:
        weights = load_file(str(path / "model.safetensors"))
        flat = load_file(str(path / "optimizer.safetensors"))
    except (OSError, SafetensorError) as exc:
        raise CheckpointError(f"{path}: unreadable tensors ({exc})") from exc
    opt: dict[str, dict[str, torch.Tensor]] = {}
    for key, v in flat.items():
        n, k = key.rsplit("::", 1)
        opt.setdefault(n, {})[k] = v
    groups = [{k: tuple(v) if isinstance(v, list) else v for k, v in g.items()} for g in meta["param_groups"]]
    return TrainerState(
        model=weights,
        optimizer=OptimizerState(state=opt, param_groups=groups),
        position={k: int(meta[k]) for k in ("step", "version", "queue_position")},
        layout=str(meta["layout"]),
        model_config=dict(meta.get("model", {})),
    )
