"""Checkpoints of the core: weights, AdamW state, step, version and queue position, so a resumed core
gives the same next update as one that never stopped.

Layout of a checkpoint directory: `model.safetensors` (parameters by name), `optimizer.safetensors`
(`<param>::exp_avg`, `<param>::exp_avg_sq`, `<param>::step`), `state.json` (step, version,
queue_position, parameter digest, configs). Written to a temporary directory and renamed into place, so a
crash leaves the previous checkpoint whole. No pickle anywhere.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

if TYPE_CHECKING:
    from gyre_train.core import Core

FORMAT = 1


class CheckpointError(ValueError):
    """A checkpoint that does not match the model it is loaded into, or is incomplete."""


def save(core: Core, path: Path) -> Path:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    names = {id(p): n for n, p in core.model.named_parameters()}
    save_file(
        {n: p.detach().cpu().contiguous() for n, p in core.model.named_parameters()},
        str(tmp / "model.safetensors"),
    )
    opt: dict[str, torch.Tensor] = {}
    for p, st in core.optimizer.state.items():
        n = names[id(p)]
        for k, v in st.items():
            opt[f"{n}::{k}"] = torch.as_tensor(v).detach().cpu().contiguous()
    save_file(opt, str(tmp / "optimizer.safetensors"))
    state = {
        "format": FORMAT,
        "step": core.step,
        "version": core.version,
        "queue_position": core.queue_position,
        "layout": core.layout.digest,
        "model": asdict(core.model_cfg),
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in core.optimizer.param_groups],
    }
    (tmp / "state.json").write_text(json.dumps(state, indent=1, default=list) + "\n")
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


def load(core: Core, path: Path) -> None:
    path = Path(path)
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: no readable state.json ({exc})") from exc
    if state.get("format") != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {state.get('format')}, expected {FORMAT}")
    if state["layout"] != core.layout.digest:
        raise CheckpointError(
            f"{path}: parameter layout {state['layout']} differs from the model's {core.layout.digest}"
        )
    weights = load_file(str(path / "model.safetensors"))
    opt = load_file(str(path / "optimizer.safetensors"))
    ps = dict(core.model.named_parameters())
    with torch.no_grad():
        for n, p in ps.items():
            p.copy_(weights[n])
    sd = core.optimizer.state_dict()
    index = {n: i for i, n in enumerate(ps)}
    new_state: dict[int, dict[str, torch.Tensor]] = {}
    for key, v in opt.items():
        n, k = key.rsplit("::", 1)
        if n not in index:
            raise CheckpointError(f"{path}: optimizer state for unknown parameter {n!r}")
        new_state.setdefault(index[n], {})[k] = v
    for g, saved in zip(sd["param_groups"], state["param_groups"], strict=True):
        g.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})
    core.optimizer.load_state_dict({"state": new_state, "param_groups": sd["param_groups"]})
    core.step = int(state["step"])
    core.version = int(state["version"])
    core.queue_position = int(state["queue_position"])
    core._next_seq = core.queue_position
    core.republish()
