"""The program every rank of a multi-rank core cell runs in `test_cell.py` (started by
`python -m gyre_train.launch --nproc N cell_prog.py ...`): rank 0 builds the `Core` for the cell, loads
the test's one-rank weights into every rank's part, and, as the mode asks, writes the summed gradient of
mini-batch A (alone, then with a satellite cell helping), trains a burst with a satellite joining
mid-step, and writes the whole weights and their transformers export; or trains A, checkpoints, trains
B, loads the checkpoint and trains B again (`--resume`); the other ranks follow rank 0.
Results are safetensors and JSON files in --out (no pickle crosses a process boundary)."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch
from gyre_base.testing import until
from gyre_train.cell import ParallelConfig, join_cell
from gyre_train.core import Core, CoreConfig
from gyre_train.data import synthetic_minibatch
from gyre_train.follower import follow
from gyre_train.model import ModelConfig, build_model
from gyre_traj.loss import LossConfig
from safetensors.torch import load_file, save_file

A = synthetic_minibatch(4, seed=11)
B = synthetic_minibatch(4, seed=12)


def model_config(backend: str) -> ModelConfig:
    return ModelConfig(backend=backend)


def core_config(wire_dtype: str) -> CoreConfig:
    return CoreConfig(token_budget=512, loss=LossConfig(mode="tis"), wire_dtype=wire_dtype, heartbeat_s=0.25)


def save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--model-backend", default="megatron")
    ap.add_argument("--weights", help="one-rank weights to load (safetensors)")
    ap.add_argument("--satellite", help="name of a satellite cell that will say hello")
    ap.add_argument("--wire-dtype", default="float32")
    ap.add_argument("--burst", action="store_true", help="train A, B with the satellite joining mid-step")
    ap.add_argument(
        "--resume",
        action="store_true",
        help="train A, checkpoint, train B; load the checkpoint, train B again",
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    warnings.simplefilter("ignore")  # megatron-core's deprecation notes on every forward
    torch.set_num_threads(1)
    out = Path(args.out)
    cell = join_cell(ParallelConfig(tp=args.tp, pp=args.pp, dp=args.dp))
    if cell.rank != 0:
        try:
            return follow(cell)
        finally:
            cell.close()
    mc = model_config(args.model_backend)
    core = Core(build_model(mc), mc, core_config(args.wire_dtype), cell)
    try:
        (out / "core.json").write_text(json.dumps({"address": core.address}))
        if args.weights:
            core.load_whole_weights(load_file(args.weights))
        result: dict[str, object] = {}
        if args.resume:
            core.train_burst([A])
            core.save(out / "ckpt")
            result["loss"] = [r.loss for r in core.train_burst([B])]
            save(core.whole_weights(), out / "uninterrupted.safetensors")
            core.load(out / "ckpt")
            result["loss_resumed"] = [r.loss for r in core.train_burst([B])]
            save(core.whole_weights(), out / "resumed.safetensors")
            (out / "result.json").write_text(json.dumps(result))
            return 0
        if not args.burst:
            g = core.gradient(A)
            save(g.gradient, out / "grad.safetensors")
            result["loss"] = g.loss
        sat = args.satellite
        if sat:
            until(lambda: core.replicas().get(sat, {}).get("ready", False), "the satellite cell", 300.0)

            joined: list[bool] = []

            def join_after_first(k: int) -> None:  # the satellite joins after the core's first round
                if not joined:
                    joined.append(True)
                    core.admit(sat)
                    until(lambda: core.replicas()[sat]["claims"] > 0 or core.pending() == 0, "a claim", 120.0)

            if args.burst:
                reports = core.train_burst([A, B], on_progress=join_after_first)
                result["by_replica"] = [r.by_replica for r in reports]
                result["loss"] = [r.loss for r in reports]
            else:
                with_sat = core.gradient(A, on_progress=join_after_first)
                save(with_sat.gradient, out / "grad_with_satellite.safetensors")
                result["loss_with_satellite"] = with_sat.loss
                result["satellite_gradients"] = core.replicas()[sat]["gradients"]
        save(core.whole_weights(), out / "weights.safetensors")
        save(core.hf_weights(), out / "hf.safetensors")
        (out / "result.json").write_text(json.dumps(result))
    finally:
        core.close()
        cell.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
