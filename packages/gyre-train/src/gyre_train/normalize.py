"""Loss weights for a streamed step: per-execution token means, divided by the step's execution count
only when the step closes.

gyre-traj's `pack` weights each loss token 1 / (its execution's loss tokens x the executions packed
together), so a whole mini-batch packed at once carries the batch's normalization. A step fed group by
group does not know its final execution count until it closes. `execution_means` re-weights what `pack`
made from part of a step (one group, say) to 1 / (its execution's loss tokens) and returns how many
executions carry loss; the step is closed with the sum of those counts (`CloseStep.executions`), and the
core divides the in-order sum of the gradients by it once, at close. Mathematically that is the
whole-batch loss; in floats it differs from packing the whole batch at once only by rounding (tested).
Group advantages are per group, so packing group by group leaves them unchanged bit for bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from gyre_traj.pack import PackedBatch


def execution_means(microbatches: Sequence[PackedBatch]) -> tuple[list[PackedBatch], int]:
    """`microbatches` (every micro-batch of one `pack` call: each execution's loss tokens must all be
    among them) with loss weights 1 / (the execution's loss tokens), and the number of executions that
    have loss tokens. Needs `PackedBatch.executions` (set by `pack`; not carried over the wire)."""
    counts: dict[str, int] = {}
    owners = []
    for b in microbatches:
        if b.num_loss_tokens and not b.executions:
            raise ValueError("micro-batches without execution names: re-weight them where they were packed")
        ex = np.asarray(b.executions, dtype=object)[b.segment[b.target_pos]] if b.num_loss_tokens else []
        owners.append(ex)
        for e in ex:
            counts[e] = counts.get(e, 0) + 1
    out = [
        dataclasses.replace(b, weights=np.array([1.0 / counts[e] for e in ex], dtype=np.float32))
        if b.num_loss_tokens
        else b
        for b, ex in zip(microbatches, owners, strict=True)
    ]
    return out, len(counts)
