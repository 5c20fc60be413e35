"""Defaults of the core's settings that a run configuration shares (gyre's `[train]` takes them from here),
in a module that imports nothing, so reading a configuration does not load torch."""

from __future__ import annotations

MISMATCH_WARN = 0.1
"""`CoreConfig.mismatch_warn`: a step whose on-policy tokens' mean |trainer - behaviour logprob| is above
this logs a warning (in nats: a trainer and an engine computing alike differ by float noise, far below
it; weights not loaded, another temperature or another tokenization go far above)."""

TENSOR_PARALLEL = 1
"""`cell.ParallelConfig.tp`: tensor-parallel ranks of a cell (one: the model whole on one rank)."""

PIPELINE_PARALLEL = 1
"""`cell.ParallelConfig.pp`: pipeline stages of a cell."""
