"""Defaults of the core's settings that a run configuration shares (gyre's `[train]` takes them from here),
in a module that imports nothing, so reading a configuration does not load torch."""

from __future__ import annotations

from typing import Final

MISMATCH_WARN = 0.1
"""`CoreConfig.mismatch_warn`: a step whose on-policy tokens' mean |trainer - behaviour logprob| is above
this logs a warning (in nats: a trainer and an engine computing alike differ by float noise, far below
it; weights not loaded, another temperature or another tokenization go far above)."""

TENSOR_PARALLEL = 1
"""`cell.ParallelConfig.tp`: tensor-parallel ranks of a cell (one: the model whole on one rank)."""

PIPELINE_PARALLEL = 1
"""`cell.ParallelConfig.pp`: pipeline stages of a cell."""

CHUNK_BUDGET = 0
"""`CoreConfig.chunk_budget`: a micro-batch with more tokens than this trains in chunks of at most this many
(the shared prefix computed once), so activation memory is one chunk's and `token_budget` may be far
larger; 0: off (a micro-batch trains in one pass)."""

CHUNK_MEMORY: Final = "auto"
"""`CoreConfig.chunk_memory`: how a micro-batch larger than `chunk_budget` keeps what its chunks share.
"kept" = every layer's shared keys/values and their float32 gradients on the device (`chunked.py`: 336
KiB per shared token on the Qwen3-0.6B shape); "layers" = layer by layer, keeping each layer's input
hidden states on the device (`layered.py`: 56 KiB per token); "layers-host" = the same with the layer
inputs in page-locked host memory (copied on a side CUDA stream); "auto" = the first of these whose kept
state fits the free memory (always "kept" on the CPU)."""


TREE_CHUNK_ELEMENTS = 1 << 30
"""On a FlexAttention model, a micro-batch trained in chunks of `chunk_budget` tokens with `chunk_budget` x
its tokens at most this many is computed with tree attention (`gyre_train.treeattn`: flash attention over
the tree's runs), which needs no compilation; a larger one with FlexAttention, whose first use compiles
kernels for minutes (a 27k-token micro-batch in 16k chunks: 206 s on an H200, against seconds to compute)
but reads every ancestor's keys in place, where tree attention gathers a branch's ancestors' keys and
values for each layer and keeps them for backward (a branch of a 650k-token trunk: about 2.7 GB a layer
on the Qwen3-0.6B shape). Below 2**30, a chunk's gathers are at most its tokens' keys."""


def warmup_rounds(device_type: str) -> int:
    """Warm-up rounds a trainer replica computes at start by default: 2 on a GPU (the attention kernels
    compiled for dynamic shapes before real work), none on the CPU (nothing to compile)."""
    return 2 if device_type == "cuda" else 0
