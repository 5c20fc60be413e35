"""Megatron-core tensor parallel 2 against tensor parallel 1, on two GPUs of one host (one device call
on an `nvidia-h200-x2`, from the repository root):

    python packages/gyre-train/bench/tp2_cuda.py --out $OUT/tp2.json

with PYTHONPATH over packages/gyre-traj/src, packages/gyre-xfer/src and packages/gyre-train/src, and the
wheels the GPU machine lacks (megatron-core, msgspec, pyzmq) installed from a carried `.whl/` folder,
as the package README says.

1. One rank, in this process, on GPU 0: a Qwen3-0.6B-shaped Megatron-core model (`--layers` of them)
   computes the summed tree-packed gradient of a synthetic mini-batch (`Core.gradient`: the claim queue,
   the in-order float32 sum) `--repeats` times after a warm-up; its weights and gradient are saved.
2. A tensor-parallel-2 core cell, GPU 0 and GPU 1, NCCL (`gyre_train.launch` forks the two ranks; rank 0
   runs this file with `--cell`): it loads the same weights into its shards and does the same.
3. The JSON written to --out: `tp2_grad_max_rel_err` (largest |TP2 - TP1| over the largest |TP1|, whole
   gradient in the one-rank layout), `tp2_loss_rel_err`, and `tokens_per_s` of both (tokens of the
   mini-batch over the summed forward and backward seconds of its micro-batches, medians of repeats).

`--device cpu --backend gloo --layers 2` runs the same steps on a CPU (small, for checking the script).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch


def model_config(args: argparse.Namespace) -> Any:
    from gyre_train.model import ModelConfig

    if args.device == "cpu":
        return ModelConfig(backend="megatron", num_hidden_layers=args.layers, dtype=args.dtype)
    return ModelConfig(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=args.layers,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, dtype=args.dtype, backend="megatron",
    )  # fmt: skip


def minibatch(args: argparse.Namespace) -> list[Any]:
    from gyre_train.data import synthetic_minibatch
    from gyre_traj.synth import SynthConfig

    if args.device == "cpu":
        return synthetic_minibatch(4, seed=21)
    synth = SynthConfig(main_calls=24, max_context=6000, compactions=1, subagents=2, subagent_calls=4,
                        subagent_compactions=0, retries=2, system_tokens=1000, output_tokens=(50, 300),
                        summary_tokens=200, seed=1)  # fmt: skip
    return synthetic_minibatch(4, seed=21, token_budget=args.budget, synth=synth)


def core_config(args: argparse.Namespace) -> Any:
    from gyre_train.core import CoreConfig
    from gyre_traj.loss import LossConfig

    return CoreConfig(token_budget=args.budget, loss=LossConfig(mode="tis"), transport="shm")


def measure(core: Any, mbs: list[Any], repeats: int) -> tuple[Any, list[float], float]:
    """A warm-up, then `repeats` timed gradients: the last result, the forward+backward seconds of each,
    and the wall seconds of the last (with the queue, the sums and the gather)."""
    core.gradient(mbs)
    times, wall, g = [], 0.0, None
    for _ in range(repeats):
        t0 = time.perf_counter()
        g = core.gradient(mbs)
        wall = time.perf_counter() - t0
        times.append(g.compute_s)
    return g, times, wall


def save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().float().cpu().contiguous() for k, v in tensors.items()}, str(path))


def reference(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """TP 1 in this process (GPU 0)."""
    from gyre_train.core import Core
    from gyre_train.model import build_model

    mc = model_config(args)
    device = "cuda:0" if args.device == "cuda" else "cpu"
    core = Core(build_model(mc, "dense", device), mc, core_config(args))
    try:
        from safetensors.torch import save_file

        save_file(
            {k: v.contiguous().cpu() for k, v in core.whole_weights().items()},
            str(tmp / "weights.safetensors"),
        )
        g, times, wall = measure(core, minibatch(args), args.repeats)
        save(g.gradient, tmp / "tp1.safetensors")
        params = sum(p.numel() for p in core.model.parameters())
    finally:
        core.close()
    return {"loss": g.loss, "tokens": g.tokens, "compute_s": times, "wall_s": wall, "params": params}


def cell(args: argparse.Namespace) -> int:
    """Every rank of the TP 2 cell runs this (rank 0 the core, the other rank follows)."""
    from gyre_train.cell import ParallelConfig, join_cell
    from gyre_train.core import Core
    from gyre_train.follower import follow
    from gyre_train.model import build_model
    from safetensors.torch import load_file

    warnings.simplefilter("ignore")
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    c = join_cell(ParallelConfig(tp=2, backend=args.backend))
    try:
        if c.rank != 0:
            return follow(c)
        mc = model_config(args)
        core = Core(build_model(mc, "dense", str(c.device(args.device))), mc, core_config(args), c)
        try:
            core.load_whole_weights(
                {k: v.to(getattr(torch, args.dtype)) for k, v in load_file(args.weights).items()}
            )
            g, times, wall = measure(core, minibatch(args), args.repeats)
            save(g.gradient, Path(args.tmp) / "tp2.safetensors")
            (Path(args.tmp) / "tp2.json").write_text(
                json.dumps({"loss": g.loss, "tokens": g.tokens, "compute_s": times, "wall_s": wall})
            )
        finally:
            core.close()
        return 0
    finally:
        c.close()


def compare(tp1: dict[str, Any], tp2: dict[str, Any], tmp: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    g1, g2 = load_file(str(tmp / "tp1.safetensors")), load_file(str(tmp / "tp2.safetensors"))
    if g1.keys() != g2.keys():
        raise SystemExit(f"gradients name different tensors: {sorted(set(g1) ^ set(g2))[:5]}")
    scale = max(float(v.abs().max()) for v in g1.values())
    err = max(float((g2[k] - g1[k]).abs().max()) for k in g1) / scale
    per_tensor = {k: float((g2[k] - g1[k]).abs().max()) / max(float(g1[k].abs().max()), 1e-30) for k in g1}
    worst = max(per_tensor, key=per_tensor.__getitem__)
    t1, t2 = statistics.median(tp1["compute_s"]), statistics.median(tp2["compute_s"])
    return {
        "tp2_grad_max_rel_err": err,
        "tp2_worst_tensor": worst,
        "tp2_worst_tensor_rel_err": per_tensor[worst],
        "tp2_loss_rel_err": abs(tp2["loss"] - tp1["loss"]) / max(abs(tp1["loss"]), 1e-30),
        "tokens": tp1["tokens"],
        "tokens_per_s_tp1": tp1["tokens"] / t1,
        "tokens_per_s_tp2": tp2["tokens"] / t2,
        "tp2_speedup": t1 / t2,
        "tp1": tp1,
        "tp2": tp2,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the JSON here")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--budget", type=int, default=8192, help="token budget of a micro-batch")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cell", action="store_true", help="(internal) run as a rank of the TP 2 cell")
    ap.add_argument("--weights", help="(internal) the TP 1 weights")
    ap.add_argument("--tmp", help="(internal) where the cell writes")
    args = ap.parse_args()
    if args.cell:
        return cell(args)
    warnings.simplefilter("ignore")
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        t0 = time.perf_counter()
        tp1 = reference(args, tmp)
        ref_s = time.perf_counter() - t0
        cmd = [sys.executable, "-m", "gyre_train.launch", "--nproc", "2", "--preload", "megatron", __file__, "--cell",
               "--weights", str(tmp / "weights.safetensors"), "--tmp", str(tmp),
               *(f"--{k}={v}" for k, v in (("device", args.device), ("backend", args.backend), ("dtype", args.dtype),
                                            ("layers", args.layers), ("budget", args.budget),
                                            ("repeats", args.repeats)))]  # fmt: skip
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
        if rc != 0:
            raise SystemExit(f"the TP 2 cell failed ({rc})")
        cell_s = time.perf_counter() - t0
        tp2 = json.loads((tmp / "tp2.json").read_text())
        result = {
            "bench": "gyre-train tp2_cuda",
            "device": args.device,
            "backend": args.backend,
            "torch": torch.__version__,
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if args.device == "cuda" else [],
            "model": dataclasses.asdict(model_config(args)),
            "microbatches": len(minibatch(args)),
            "reference_s": ref_s,
            "cell_s": cell_s,
            **compare(tp1, tp2, tmp),
        }  # fmt: skip
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
