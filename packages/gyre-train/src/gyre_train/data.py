"""Mini-batches for tests, the benchmark and `gyre-train core --synthetic`: gyre-traj's synthetic agent
executions (compactions, sub-agents, retries), selected with J_max, given group-relative advantages and
tree-packed under a token budget. Also reads a directory written by `gyre-traj pack`.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
from gyre_traj.pack import PackConfig, PackedBatch, PackItem, pack
from gyre_traj.select import SelectionConfig, select
from gyre_traj.synth import SynthConfig, synth_execution
from gyre_traj.tree import ExecutionTree

from gyre_train.wire import MICROBATCH_FIELDS, MicroBatchError, microbatch_from_arrays

SMALL = SynthConfig(
    main_calls=6,
    max_context=200,
    compactions=1,
    subagents=1,
    subagent_calls=2,
    subagent_compactions=0,
    retries=1,
    system_tokens=30,
    output_tokens=(6, 20),
    summary_tokens=20,
)


def synthetic_minibatch(
    executions: int = 4,
    seed: int = 0,
    token_budget: int = 512,
    synth: SynthConfig = SMALL,
    j_max: int = 3,
    mode: str = "tree",
) -> list[PackedBatch]:
    """One mini-batch (a group of `executions`) of tree-packed micro-batches."""
    rng = np.random.default_rng(seed)
    trees = []
    for k in range(executions):
        eid = f"s{seed}-e{k}"
        t = ExecutionTree(eid)
        for c in synth_execution(SynthConfig(**{**synth.__dict__, "seed": seed * 1000 + k}), eid):
            t.add(c)
        trees.append(t)
    scores = rng.uniform(0, 1, size=executions)
    adv = scores - scores.mean()
    items = [
        PackItem(t, select(t, SelectionConfig(j_max=j_max)), float(a))
        for t, a in zip(trees, adv, strict=True)
    ]
    return pack(items, PackConfig(token_budget=token_budget, mode=mode))  # type: ignore[arg-type]


def warmup_microbatches(
    seed: int, vocab_size: int, token_budget: int = 1 << 14, chunk_budget: int = 0
) -> list[PackedBatch]:
    """Micro-batches of one synthetic execution (their lengths differ by `seed`) with every token id
    folded into `vocab_size`: what a replica computes at start to compile its kernels before real work.
    With a `chunk_budget` below `token_budget`, one more micro-batch of a long execution above the chunk
    budget (and within `token_budget`) comes last, so the chunked path (`gyre_train.chunked`: a chunk over
    its ancestors' keys and values, with and without autograd) runs once before real steps and takes its
    memory then."""
    mbs = synthetic_minibatch(1, seed=seed, token_budget=token_budget)
    if 0 < chunk_budget < token_budget:
        long = chunked_warmup_microbatch(seed, chunk_budget, token_budget)
        if long is not None:
            mbs.append(long)
    return [
        replace(mb, input_ids=mb.input_ids % vocab_size, target_ids=mb.target_ids % vocab_size) for mb in mbs
    ]


def chunked_warmup_microbatch(seed: int, chunk_budget: int, token_budget: int) -> PackedBatch | None:
    """A synthetic micro-batch of one execution of more than `chunk_budget` and at most `token_budget`
    tokens whose trunk runs past the first chunk (so later chunks attend to kept ancestors), or None where
    no such execution fits between the two budgets."""
    for scale in (1.0, 0.8, 0.6, 0.45):
        t = int(2 * chunk_budget * scale)
        synth = replace(
            SMALL,
            main_calls=8,
            max_context=t // 2,
            system_tokens=t // 16,
            output_tokens=(max(6, t // 200), max(20, t // 50)),
            summary_tokens=max(20, t // 30),
        )
        mb = synthetic_minibatch(1, seed=seed, token_budget=1 << 40, synth=synth)[0]
        if chunk_budget < mb.num_tokens <= token_budget:
            return mb
    return None


def read_packed_dir(path: Path) -> list[PackedBatch]:
    """Micro-batches from a `gyre-traj pack --out DIR` directory (manifest.json + .npz files)."""
    manifest = json.loads((path / "manifest.json").read_text())
    files = [m["file"] for m in manifest["micro_batches"]]
    out = []
    for name in files:
        with np.load(path / name, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files if k in MICROBATCH_FIELDS}
        try:
            out.append(microbatch_from_arrays(arrays))
        except MicroBatchError as exc:
            raise MicroBatchError(f"{path / name}: {exc}") from exc
    return out
