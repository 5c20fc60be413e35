"""Tree training of a very long trunk with branches on one GPU, layer by layer (`gyre_train.layered`), against
path-expanded training. On one H200, from the repository root:

    python packages/gyre-train/bench/long_tree.py --out $OUT/long_tree.json

(PYTHONPATH and wheels as for `tp2_cuda.py` in the package README). For each size (`--sizes`, default
`256k,700k`): a fan tree on the Qwen3-0.6B shape (random weights, bf16, FlexAttention), trained once under
an 8,192-token chunk budget with `--memory` (default `layers-host`: layer inputs in page-locked host
memory, copies on a side stream); `256k` = 262,144-token trunk + 8 branches of 2,048 (the tree of
`results-h200-huge.json`), `700k` = 650,000 + 8 x 6,000. Keys per size (`tree_<size>_...`):
`ideal_fraction` (achieved / ideal ratio), `ideal_ratio` (path-expanded tokens / tree tokens),
`achieved_ratio` (path-expanded time / tree time), `peak_gib` (torch.cuda.max_memory_allocated of the tree
step), `host_gib` (page-locked layer inputs), `step_s` (the tree step, wall clock), `transfer_share`
(copy-stream time, CUDA events, over the step time: the copies overlap compute, so this is their load, not
a stall). Path-expanded time is measured on a sample that fits and scaled per token to all paths: by
default one of the tree's own paths (trunk + one branch: every path of a fan is equally long, so this is
also one path's time x paths, as `gyre-train bench --cases huge-tree` does), trained under the same budget
with the same `--memory`; `--path N` times a path with an N-token trunk instead (attention costs less per
token on a shorter path, so that underestimates path-expanded time and the achieved ratio). `--layers L`
runs the shape with L decoder layers (the work per layer is the same in every layer, so the ratios do not
depend on it; times and memory do). A size whose kept state does not fit fails with `TreeMemoryError`
naming the bytes each method needs (recorded under `tree_<size>_error`; exit status 1), not with an out-of-memory crash.

`--cpu --tiny` runs the same steps on the CPU with a 4-layer model and small trees (checks the script).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch
from gyre_train.bench.run import QWEN3_06B, Fan, fan_tree, packs
from gyre_train.chunked import chunked_loss_backward
from gyre_train.layered import TreeMemoryError, choose, layered_bytes, layered_loss_backward
from gyre_train.layerstore import LayerStore
from gyre_train.model import ModelConfig, build_model
from gyre_traj.loss import LossConfig
from gyre_traj.pack import PackedBatch

GPU_SIZES = {"256k": Fan(262144, 8, 2048), "700k": Fan(650_000, 8, 6_000)}
TINY_SIZES = {"256k": Fan(1024, 8, 64), "700k": Fan(2600, 8, 192)}
TINY = ModelConfig(
    vocab_size=8192, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
)  # fmt: skip


def _sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def _peak_reset(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _gib(n: float) -> float:
    return n / 2**30


def _train(
    model: Any,
    b: PackedBatch,
    budget: int,
    memory: str,
    attention: Any,
    dev: str,
    store: LayerStore | None = None,
) -> dict[str, float]:
    cfg = LossConfig(mode="tis")
    model.zero_grad(set_to_none=True)
    _sync(dev)
    t0 = time.perf_counter()
    if memory == "kept":
        m = chunked_loss_backward(model, b, budget, cfg, attention)
    else:
        m = layered_loss_backward(model, b, budget, cfg, attention, host=memory == "layers-host", store=store)
    _sync(dev)
    m["step_s"] = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return m


def mc_layers(model: Any) -> int:
    return int(model.config.num_hidden_layers)


def _store(model: Any, b: PackedBatch, pick: str) -> LayerStore | None:
    if pick == "kept":
        return None
    p = next(model.parameters())
    host = pick == "layers-host"
    return LayerStore(mc_layers(model), b.num_tokens, model.config.hidden_size, p.dtype, p.device, host)


def say(msg: str) -> None:
    """Progress on stderr, so a run cut off by a time limit still shows how far it got."""
    print(f"[long_tree {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def path_seconds_per_token(
    model: Any, b: PackedBatch, budget: int, memory: str, attention: Any, dev: str
) -> dict[str, Any]:
    """One path-expanded micro-batch `b` (a trunk and one branch) trained under `budget` with `memory`
    (or, for "auto", the first method that fits it): its seconds per token."""
    pick = choose(b, budget, model, memory)  # type: ignore[arg-type]
    store = _store(model, b, pick)
    s = _train(model, b, budget, pick, attention, dev, store)["step_s"]
    del store
    return {"path_sample_tokens": b.num_tokens, "path_sample_memory": pick, "path_sample_s": s,
            "path_s_per_token": s / b.num_tokens}  # fmt: skip


def full_depth(model: Any, full_layers: int, m: dict[str, Any], peak: float) -> dict[str, Any]:
    """Estimates for the shape's own depth from a run with fewer layers: every decoder layer does the same
    work and keeps the same input, so step time and host bytes scale with the layer count (the step's
    per-token head and embedding are counted that many times too, so the step is overestimated), and
    peak device memory grows by the added layers' parameters and their gradients."""
    layers = mc_layers(model)
    per_layer = sum(p.numel() * p.element_size() * 2 for p in model.model.layers[0].parameters())
    k = full_layers / layers
    return {"layers": full_layers, "step_s": m["step_s"] * k, "host_gib": _gib(m.get("host_bytes", 0.0) * k),
            "peak_gib": _gib(peak + (full_layers - layers) * per_layer)}  # fmt: skip


def one_size(
    name: str, model: Any, f: Fan, budget: int, memory: str, path_trunk: int, attention: Any, dev: str,
    repeat: int = 1, full_layers: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """The tree of `f` trained `repeat` times with `memory` (the last step is the figure: a first step
    at a new size can include kernel compilation); path-expanded time from one of its own paths
    (`path_trunk` 0) or from a path with a `path_trunk`-token trunk, scaled per token to all paths."""
    tb, pb = packs(fan_tree(f, seed=2), f.branches)
    tree = tb[0]
    expanded = sum(b.num_tokens for b in pb)
    pick = choose(tree, budget, model, memory)  # type: ignore[arg-type]
    t0 = time.perf_counter()  # page-locking the host store is set-up, not a step's work
    store = _store(model, tree, pick)
    setup_s = time.perf_counter() - t0
    _peak_reset(dev)
    say(f"{name}: tree of {tree.num_tokens} tokens, {pick}, host store set up in {setup_s:.1f} s; training")
    steps = []
    for _ in range(max(1, repeat)):
        m = _train(model, tree, budget, pick, attention, dev, store)
        steps.append(m["step_s"])
        say(f"{name}: tree step {m['step_s']:.1f} s")
    peak = torch.cuda.max_memory_allocated() if dev == "cuda" else float("nan")
    say(f"{name}: peak {_gib(peak):.2f} GiB; timing a path")
    del store
    sample = pb[0] if not path_trunk else packs(fan_tree(Fan(path_trunk, 1, f.branch), seed=4), 1)[1][0]
    path = path_seconds_per_token(model, sample, budget, memory, attention, dev)
    say(f"{name}: path of {sample.num_tokens} tokens in {path['path_sample_s']:.1f} s")
    ideal = expanded / tree.num_tokens
    achieved = path["path_s_per_token"] * expanded / m["step_s"]
    p = f"tree_{name}_"
    return {
        p + "ideal_fraction": achieved / ideal,
        p + "ideal_ratio": ideal,
        p + "achieved_ratio": achieved,
        p + "peak_gib": _gib(peak),
        p + "host_gib": _gib(m.get("host_bytes", 0.0)),
        p + "step_s": m["step_s"],
        p + "transfer_share": m.get("transfer_s", 0.0) / m["step_s"],
        p + "detail": {
            "layers": mc_layers(model), "trunk": f.trunk, "branches": f.branches, "branch": f.branch, "chunk_budget": budget,
            "tree_tokens": tree.num_tokens, "expanded_tokens": expanded, "memory": pick,
            "kept_estimate_gib": {k: _gib(v) for k, v in layered_bytes(tree, budget, model, pick == "layers-host").items()},
            "chunks": m["chunks"], "shared_chunks": m["shared_chunks"], "transfer_s": m.get("transfer_s", 0.0),
            "loss": m["loss"], "store_setup_s": setup_s, "tree_steps_s": steps, **path,
        },
        **({p + "full_depth_estimate": full_depth(model, full_layers, m, peak)}
           if full_layers and full_layers != mc_layers(model) else {}),
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (with --tiny: checks the script)")
    ap.add_argument("--tiny", action="store_true", help="a 4-layer model and small trees")
    ap.add_argument("--sizes", default="256k,700k", help="comma-separated subset of 256k, 700k")
    ap.add_argument("--memory", default="layers-host", choices=["auto", "kept", "layers", "layers-host"])
    ap.add_argument(
        "--path",
        type=int,
        default=0,
        help="0: time one of the tree's own paths (all equally long) and scale it to all paths; N: a "
        "path with an N-token trunk instead, scaled per token (attention costs less per token "
        "on a shorter path, so this underestimates path-expanded time)",
    )
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (default: the shape's 28); fewer to fit a "
                    "time limit: the work per layer is the same, so the ratios do not depend on it")  # fmt: skip
    ap.add_argument("--repeat", type=int, default=1, help="tree steps per size; the last is the figure (a "
                    "size's first step can include kernel compilation for its lengths)")  # fmt: skip
    ap.add_argument("--out", default="", help="write the JSON here too")
    args = ap.parse_args()
    dev = "cpu" if args.cpu else "cuda"
    if dev == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --cpu --tiny")
    sizes, mc = (TINY_SIZES, TINY) if args.tiny else (GPU_SIZES, QWEN3_06B)
    full_layers = mc.num_hidden_layers
    if args.layers:
        mc = ModelConfig(
            mc.arch, seed=mc.seed, dtype=mc.dtype, backend=mc.backend, num_hidden_layers=args.layers
        )
    budget = 256 if args.tiny else 8192
    sample = args.path
    attention: Any = "dense" if dev == "cpu" else "flex"
    want = [s for s in args.sizes.split(",") if s]
    if unknown := set(want) - set(sizes):
        raise SystemExit(f"unknown --sizes {sorted(unknown)}: choose from {sorted(sizes)}")
    if dev == "cpu":
        torch.set_num_threads(1)  # a shared small machine: one thread measures the work, not OpenMP waits
    torch.manual_seed(0)
    model = build_model(mc, attention, dev)
    if args.cpu:
        model = model.float()
    out: dict[str, Any] = {
        "bench": "gyre-train long-tree",
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        "torch": torch.__version__,
        "model": {k: getattr(mc, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "dtype")},
        "memory": args.memory,
        "path_scaling": "path-expanded time = seconds per token of one path x path-expanded tokens; the path: "
        + ("one of the tree's own (all equally long)" if not sample else f"a {sample}-token trunk + one branch"),
        "layers": mc.num_hidden_layers,
    }  # fmt: skip
    t0 = time.perf_counter()
    warm = Fan(4 * budget, 2, sizes["700k"].branch)  # kernels and FlexAttention compilation, both methods
    wt, _ = packs(fan_tree(warm, seed=3), 2)
    _train(model, wt[0], budget, "layers-host" if args.memory == "layers-host" else "layers", attention, dev)
    path_seconds_per_token(model, wt[0], budget, "kept", attention, dev)
    out["warmup_s"] = time.perf_counter() - t0
    say(f"warm-up (kernels, FlexAttention compilation) {out['warmup_s']:.1f} s")
    failed = False
    for name in want:
        try:
            out.update(
                one_size(
                    name,
                    model,
                    sizes[name],
                    budget,
                    args.memory,
                    sample,
                    attention,
                    dev,
                    args.repeat,
                    full_layers,
                )
            )
        except TreeMemoryError as exc:
            failed = True
            out[f"tree_{name}_error"] = str(exc)
            print(f"tree_{name}: {exc}", file=sys.stderr)
        print(
            json.dumps({k: v for k, v in out.items() if k.startswith(f"tree_{name}_") and "detail" not in k}),
            flush=True,
        )
    out["total_s"] = time.perf_counter() - t0
    text = json.dumps(out, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
