"""`gyre-train bench [--quick] [--device cuda]`: time per mini-batch of tree-packed against path-expanded
training of the same branched executions (fan trees: a trunk with branches, and gyre-traj's synthetic
agent executions), a tree larger than a micro-batch trained in chunks with the shared prefix computed
once, the time for a satellite process to join (admit -> snapshot pull -> first gradient at the core),
and the gradient hand-off per micro-batch through gyre-xfer against the old full-float32 paths
(`handoff.py`). Medians of interleaved repeats; one JSON object on the last line (`tree_speedup`,
`ideal_ratio`, `join_s`, `grad_handoff_bytes_per_mb`, `grad_handoff_s_per_mb`, ...). On CUDA it uses a
Qwen3-0.6B-shaped model with FlexAttention and reports MFU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gyre_traj.loss import LossConfig, TorchBatch, policy_loss, target_logprobs
from gyre_traj.pack import PackConfig, PackedBatch, PackItem, pack
from gyre_traj.records import Call, Delta, Role
from gyre_traj.select import SelectionConfig, select
from gyre_traj.synth import SynthConfig, synth_execution
from gyre_traj.tree import ExecutionTree

from gyre_train.chunked import chunked_loss_backward, kept_bytes, plan
from gyre_train.model import Attention, ModelConfig, build_model

H200_BF16_PEAK = 989e12  # dense bf16 tensor-core peak, FLOP/s

CPU_MODEL = ModelConfig(
    vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
)  # fmt: skip
QWEN3_06B = ModelConfig(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, dtype="bfloat16",
)  # fmt: skip
JOIN_CPU = ModelConfig(
    vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=4, head_dim=64,
)  # fmt: skip
JOIN_15B = ModelConfig(
    vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
    num_attention_heads=12, num_key_value_heads=2, head_dim=128, tie_word_embeddings=True, dtype="bfloat16",
)  # fmt: skip


@dataclass(frozen=True)
class Fan:
    trunk: int
    branches: int
    branch: int


def fan_tree(f: Fan, seed: int = 0) -> ExecutionTree:
    """One execution: a trunk call, then `branches` calls that each keep the whole trunk and append a
    tool result and their own output (parallel samples / retries / sub-agent forks off one context)."""
    rng = np.random.default_rng(seed)
    t = ExecutionTree("fan")
    out_n = max(1, f.trunk // 8)
    inp = (1000 + rng.integers(0, 3000, f.trunk - out_n)).astype(np.int32)
    out = (4000 + rng.integers(0, 2000, out_n)).astype(np.int32)
    lp = -rng.exponential(0.5, out_n).astype(np.float32)
    t.add(Call(execution_id="fan", call_id="trunk", agent_id="main", role=Role.MAIN, input_ids=inp,
               output_ids=out, output_logprobs=lp, weight_version=0))  # fmt: skip
    for b in range(f.branches):
        tool = (3000 + rng.integers(0, 1000, f.branch // 4)).astype(np.int32)
        n = f.branch - tool.shape[0]
        bo = (4000 + rng.integers(0, 2000, n)).astype(np.int32)
        t.add(Call(execution_id="fan", call_id=f"b{b}", agent_id="main", role=Role.MAIN,
                   input_delta=Delta("trunk", f.trunk, tool), output_ids=bo,
                   output_logprobs=-rng.exponential(0.5, n).astype(np.float32), weight_version=0))  # fmt: skip
    return t


def synth_tree(cfg: SynthConfig) -> ExecutionTree:
    t = ExecutionTree("synth")
    for c in synth_execution(cfg, "synth"):
        t.add(c)
    return t


def packs(tree: ExecutionTree, j_max: int) -> tuple[list[PackedBatch], list[PackedBatch]]:
    item = PackItem(tree, select(tree, SelectionConfig(j_max=j_max)), 0.5)
    longest = max(tree.path_nodes(leaf.end).shape[0] for leaf in item.selection.leaves)
    tree_b = pack([item], PackConfig(token_budget=1 << 30, mode="tree"))
    path_b = pack([item], PackConfig(token_budget=longest, mode="paths"))  # one path per micro-batch
    return tree_b, path_b


def _sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def train_time(
    model: Any, batches: list[PackedBatch], attention: Attention, dev: str, cfg: LossConfig
) -> float:
    _sync(dev)
    t0 = time.perf_counter()
    for b in batches:
        tb = TorchBatch.from_packed(b, device=dev)
        loss, _ = policy_loss(target_logprobs(model, tb, attention=attention), tb, cfg)
        loss.backward()
    _sync(dev)
    dt = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return dt


def chunked_time(
    model: Any, big: PackedBatch, budget: int, attention: Attention, dev: str, cfg: LossConfig
) -> float:
    _sync(dev)
    t0 = time.perf_counter()
    chunked_loss_backward(model, big, budget, cfg, attention)
    _sync(dev)
    dt = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return dt


def model_flops(mc: ModelConfig, batches: list[PackedBatch]) -> float:
    """Forward+backward FLOPs: 6 x non-embedding params x tokens, attention over ancestor pairs, and
    the vocabulary projection at the loss positions only."""
    h, l_, kv, hd, q = (
        mc.hidden_size,
        mc.num_hidden_layers,
        mc.num_key_value_heads,
        mc.head_dim,
        mc.num_attention_heads,
    )
    per_layer = h * (q * hd) * 2 + h * (kv * hd) * 2 + 3 * h * mc.intermediate_size
    tokens = sum(b.num_tokens for b in batches)
    pairs = sum(float((b.position_ids.astype(np.float64) + 1).sum()) for b in batches)
    targets = sum(b.num_loss_tokens for b in batches)
    return 6.0 * l_ * per_layer * tokens + 12.0 * l_ * q * hd * pairs + 6.0 * h * mc.vocab_size * targets


def compare(name: str, model: Any, mc: ModelConfig, tree: ExecutionTree, j_max: int, repeats: int,
            attention: Attention, dev: str, chunk_budget: int = 0) -> dict[str, Any]:  # fmt: skip
    tb, pb = packs(tree, j_max)
    cfg = LossConfig(mode="tis")
    unique = sum(b.num_tokens for b in tb)
    expanded = sum(b.num_tokens for b in pb)
    train_time(model, tb, attention, dev, cfg)  # warm-up (and compile, for FlexAttention)
    train_time(model, pb[:1], attention, dev, cfg)
    if chunk_budget:
        chunked_time(model, tb[0], chunk_budget, attention, dev, cfg)
        for b in pb[:1]:
            chunked_time(model, b, chunk_budget, attention, dev, cfg)
    tt, pt, ct, pct = [], [], [], []
    for _ in range(repeats):
        tt.append(train_time(model, tb, attention, dev, cfg))
        pt.append(train_time(model, pb, attention, dev, cfg))
        if chunk_budget:
            ct.append(chunked_time(model, tb[0], chunk_budget, attention, dev, cfg))
            # Path-expanded under the same memory budget: every path is chunked the same way (keys and
            # values of its earlier chunks kept, each chunk forwarded without autograd and again with it).
            pct.append(sum(chunked_time(model, b, chunk_budget, attention, dev, cfg) for b in pb))
    t_tree, t_paths = statistics.median(tt), statistics.median(pt)
    out: dict[str, Any] = {
        "case": name,
        "unique_tokens": unique,
        "expanded_tokens": expanded,
        "paths": len(pb),
        "ideal_ratio": expanded / unique,
        "tree_s": t_tree,
        "paths_s": t_paths,
        "tree_speedup": t_paths / t_tree,
        "tree_tokens_per_s": unique / t_tree,
        "paths_tokens_per_s": expanded / t_paths,
    }
    out["fraction_of_ideal"] = out["tree_speedup"] / out["ideal_ratio"]
    flops_tree, flops_paths = model_flops(mc, tb), model_flops(mc, pb)
    out["flop_ratio"] = flops_paths / flops_tree
    if chunk_budget:
        t_chunk, t_pchunk = statistics.median(ct), statistics.median(pct)
        out.update(
            chunk_budget=chunk_budget,
            tree_chunks=len(plan(tb[0], chunk_budget)),
            tree_shared_chunks=sum(c.needed for c in plan(tb[0], chunk_budget)),
            path_chunks=sum(len(plan(b, chunk_budget)) for b in pb),
            chunked_s=t_chunk,
            paths_chunked_s=t_pchunk,
            # the goal's figure: both sides under the same chunk (memory) budget
            chunked_speedup=t_pchunk / t_chunk,
            chunked_fraction_of_ideal=t_pchunk / t_chunk / out["ideal_ratio"],
            # against path-expanded micro-batches of a whole path each (memory grows with the path)
            chunked_speedup_vs_unchunked_paths=t_paths / t_chunk,
            chunking_overhead_tree=t_chunk / t_tree,
            chunking_overhead_paths=t_pchunk / t_paths,
        )
    if dev.startswith("cuda"):
        out["mfu_tree"] = flops_tree / t_tree / H200_BF16_PEAK
        out["mfu_paths"] = flops_paths / t_paths / H200_BF16_PEAK
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def _peak_reset(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(dev: str) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if dev.startswith("cuda") else float("nan")


def huge(model: Any, mc: ModelConfig, f: Fan, budget: int, attention: Attention, dev: str,
         path_sample: int, repeats: int = 1) -> dict[str, Any]:  # fmt: skip
    """The issue's regime: a fan tree whose trunk is far larger than a micro-batch (256k tokens on the
    GPU), trained chunked under `budget` tokens per chunk, against path-expanded training of the same
    paths chunked under the same budget. Nothing here fits one micro-batch, so there is no unchunked
    run. Every path of a fan tree has the same length and attention pattern (trunk + one branch), so
    path-expanded time is measured on `path_sample` of them (0: all) and scaled to all of them; the
    sampled paths' times are reported so their spread is visible. With `repeats` > 1 the tree and the
    sampled paths are timed alternately that many times and medians are used (the first round may
    include compilation for shapes the warm-up did not reach). Peak memory per side (GPU)."""
    tree = fan_tree(f, seed=2)
    tb, pb = packs(tree, f.branches)
    big = tb[0]
    lengths = {b.num_tokens for b in pb}
    if len(lengths) != 1:
        raise RuntimeError(f"fan paths differ in length: {sorted(lengths)}")
    cfg = LossConfig(mode="tis")
    # warm-up (kernels, FlexAttention compilation for varying key lengths) on a small fan, same budget
    wt, wp = packs(fan_tree(Fan(4 * budget, 2, f.branch), seed=3), 2)
    chunked_time(model, wt[0], budget, attention, dev, cfg)
    chunked_time(model, wp[0], budget, attention, dev, cfg)
    sample = pb if path_sample <= 0 else pb[:path_sample]
    tree_s: list[float] = []
    path_rounds: list[list[float]] = []
    peak_tree = peak_path = 0.0
    for _ in range(max(1, repeats)):
        _peak_reset(dev)
        tree_s.append(chunked_time(model, big, budget, attention, dev, cfg))
        peak_tree = max(peak_tree, _peak_gib(dev))
        _peak_reset(dev)
        path_rounds.append([chunked_time(model, b, budget, attention, dev, cfg) for b in sample])
        peak_path = max(peak_path, _peak_gib(dev))
    t_tree = statistics.median(tree_s)
    per_path = [statistics.median(r[i] for r in path_rounds) for i in range(len(sample))]
    unique, expanded = big.num_tokens, sum(b.num_tokens for b in pb)
    t_paths = statistics.mean(per_path) * len(pb)
    kt, kp = kept_bytes(big, budget, model), kept_bytes(pb[0], budget, model)
    out: dict[str, Any] = {
        "case": "huge-tree",
        "trunk": f.trunk, "branches": f.branches, "branch": f.branch, "chunk_budget": budget,
        "unique_tokens": unique, "expanded_tokens": expanded, "paths": len(pb),
        "ideal_ratio": expanded / unique,
        "tree_chunks": len(plan(big, budget)), "tree_shared_chunks": sum(c.needed for c in plan(big, budget)),
        "path_chunks_each": len(plan(pb[0], budget)),
        "chunked_s": t_tree, "repeats": max(1, repeats), "tree_rounds_s": tree_s,
        "paths_timed": len(sample), "per_path_s": per_path, "path_rounds_s": path_rounds,
        "paths_chunked_s": t_paths,
        "chunked_speedup": t_paths / t_tree,
        "tree_tokens_per_s": unique / t_tree, "paths_tokens_per_s": expanded / t_paths,
        "kept_tree": kt, "kept_path": kp,
    }  # fmt: skip
    out["chunked_fraction_of_ideal"] = out["chunked_speedup"] / out["ideal_ratio"]
    flops_tree, flops_paths = model_flops(mc, [big]), model_flops(mc, pb)
    out["flop_ratio"] = flops_paths / flops_tree
    if dev.startswith("cuda"):
        out["mfu_tree"] = flops_tree / t_tree / H200_BF16_PEAK
        out["mfu_paths"] = flops_paths / t_paths / H200_BF16_PEAK
        out["peak_mem_tree_gib"], out["peak_mem_path_gib"] = peak_tree, peak_path
        out["weights_gib"] = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    return out


def join(mc: ModelConfig, dev: str, timeout_s: float = 600.0) -> dict[str, Any]:
    """A satellite process, started beforehand (not timed: process, model, buffers, warm-up), is admitted
    after the core has published a new snapshot it has never seen (in a slot it has not mapped yet); time
    from `admit` until the core has accepted its first gradient (summed into the core's gradient), with
    the snapshot pull and the satellite's compute inside it."""
    from gyre_train.core import Core, CoreConfig
    from gyre_train.data import synthetic_minibatch

    core = Core(build_model(mc, "dense", dev), mc, CoreConfig(core_computes=False, token_budget=1024))
    cmd = [sys.executable, "-m", "gyre_train.cli", "satellite", "--core", core.address, "--name", "bench-sat",
           "--device", dev]  # fmt: skip
    err = tempfile.TemporaryFile()  # noqa: SIM115 (closed in the finally below)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + timeout_s
        while not core.replicas().get("bench-sat", {}).get("ready"):
            if proc.poll() is not None or time.monotonic() > deadline:
                err.seek(0)
                tail = err.read()[-3000:].decode(errors="replace")
                raise RuntimeError(f"satellite did not come up (exit code {proc.poll()}): {tail}")
            time.sleep(0.01)
        mb = synthetic_minibatch(1, seed=3, token_budget=1024)[:1]
        core.republish()  # a version the satellite has not pulled, in the publisher's other slot
        t0 = time.perf_counter()
        core.admit("bench-sat")
        core.train_step(mb)
        step_s = time.perf_counter() - t0
        info = core.replicas()["bench-sat"]
        params = sum(p.numel() for p in core.model.parameters())
        join_s, pull_s, compute_s = (
            float(info["join_s"]),
            float(info["last_pull_s"]),
            float(info["last_compute_s"]),
        )
        return {"params": params, "join_s": join_s, "pull_s": pull_s, "compute_s": compute_s,
                "handoff_s": join_s - pull_s - compute_s, "core_read_s": float(info["last_handoff_s"]),
                "tokens": mb[0].num_tokens, "step_s": step_s}  # fmt: skip
    finally:
        core.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        err.close()


def guarded(name: str, fn: Any) -> dict[str, Any]:
    """Run one case; a failure (e.g. a kernel missing on some machine) is recorded, not fatal, so the
    other cases' figures survive."""
    try:
        return dict(fn())
    except Exception as exc:
        return {"case": name, "error": f"{type(exc).__name__}: {exc}"}


def main(args: argparse.Namespace) -> int:
    dev: str = args.device
    quick: bool = args.quick
    cuda = dev.startswith("cuda")
    attention: Attention = "flex" if cuda else "dense"
    mc = QWEN3_06B if cuda else CPU_MODEL
    if not cuda:
        # One thread: on a small shared machine, OpenMP's barrier waits on whichever core another process
        # holds, which made 2-thread timings vary 10x run to run; one thread measures the work itself.
        torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(mc, attention, dev)
    repeats = 3
    if cuda:
        fan, big, big_budget = Fan(8192, 8, 2048), Fan(32768, 8, 2048), 8192
    elif quick:
        fan, big, big_budget = Fan(512, 4, 128), Fan(1024, 4, 128), 256
    else:
        fan, big, big_budget = Fan(1024, 8, 256), Fan(2048, 8, 256), 512
    synth = SynthConfig(main_calls=8 if quick else 16, max_context=800 if quick else 2000, compactions=1,
                        subagents=2, subagent_calls=3, subagent_compactions=0, retries=2, system_tokens=200,
                        output_tokens=(20, 120), summary_tokens=100, seed=1)  # fmt: skip
    if cuda:
        synth = SynthConfig(
            **{**synth.__dict__, "max_context": 16000, "main_calls": 40, "system_tokens": 2000}
        )

    want = set(args.cases.split(","))
    unknown = want - {"fan", "synthetic-agent", "large-tree-chunked", "huge-tree", "join", "handoff"}
    if unknown:
        raise SystemExit(f"unknown bench cases {sorted(unknown)}")
    skipped: dict[str, Any] = {"skipped": True}
    cases = [
        guarded("fan", lambda: compare("fan", model, mc, fan_tree(fan), fan.branches, repeats, attention, dev))
        if "fan" in want else {"case": "fan", **skipped},
        guarded("synthetic-agent", lambda: compare("synthetic-agent", model, mc, synth_tree(synth), 5, repeats,
                                                   attention, dev))
        if "synthetic-agent" in want else {"case": "synthetic-agent", **skipped},
        guarded("large-tree-chunked", lambda: compare("large-tree-chunked", model, mc, fan_tree(big, seed=1),
                                                      big.branches, 1, attention, dev, chunk_budget=big_budget))
        if "large-tree-chunked" in want else {"case": "large-tree-chunked", **skipped},
    ]  # fmt: skip
    if cuda:
        hf, h_budget = Fan(args.huge_trunk or 262144, 8, 2048), 8192
    else:
        hf, h_budget = Fan(args.huge_trunk or (1024 if quick else 4096), 4, 128), 256
    hcase = (
        guarded(
            "huge-tree",
            lambda: huge(model, mc, hf, h_budget, attention, dev, args.huge_paths, args.huge_repeats),
        )
        if "huge-tree" in want
        else {"case": "huge-tree", **skipped}
    )
    model.to("cpu")  # free the accelerator for the join test's 1.5B model
    if cuda:
        torch.cuda.empty_cache()
    j = (
        guarded("join", lambda: join(JOIN_15B if cuda else (ModelConfig() if quick else JOIN_CPU), dev))
        if "join" in want
        else skipped
    )
    from gyre_train.bench import handoff

    h = (
        guarded("handoff", lambda: handoff.run(1 << (22 if quick else 25), 3 if quick else 5))
        if "handoff" in want
        else skipped
    )
    head = cases[0]
    nan = float("nan")
    result = {
        "bench": "gyre-train",
        "quick": quick,
        "device": dev,
        "machine": platform.machine(),
        "load_avg_1m": os.getloadavg()[0],
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "model": asdict(mc),
        "tree_speedup": head.get("tree_speedup", nan),
        "ideal_ratio": head.get("ideal_ratio", nan),
        "fraction_of_ideal": head.get("fraction_of_ideal", nan),
        "large_tree_speedup": cases[2].get("chunked_speedup", nan),
        "large_tree_ideal_ratio": cases[2].get("ideal_ratio", nan),
        "large_tree_fraction_of_ideal": cases[2].get("chunked_fraction_of_ideal", nan),
        "huge_tree_speedup": hcase.get("chunked_speedup", nan),
        "huge_tree_ideal_ratio": hcase.get("ideal_ratio", nan),
        "huge_tree_fraction_of_ideal": hcase.get("chunked_fraction_of_ideal", nan),
        "join_s": j.get("join_s", nan),
        "join_pull_s": j.get("pull_s", nan),
        "join_params": j.get("params", 0),
        "grad_handoff_bytes_per_mb": h.get("grad_handoff_bytes_per_mb", {}),
        "grad_handoff_s_per_mb": h.get("grad_handoff_s_per_mb", {}),
        "cases": cases,
        "huge_tree": hcase,
        "join": j,
        "handoff": h,
    }
    if cuda:
        result["mfu_tree"] = head.get("mfu_tree", nan)
    for c in [*cases, hcase]:
        print(json.dumps(c), file=sys.stderr)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0
