"""Where each cell runs, and how its engine is sized: the one place that turns `[cell]` and `[engine]`
into a cell's environment and its `gyre-engine serve` options.

On CUDA every cell process sees exactly one GPU (`CUDA_VISIBLE_DEVICES`), so its engine and its trainer
replica both address it as `cuda:0`. Which GPU: `[cell] gpus` (one index per cell, shared GPUs allowed),
else cell i takes GPU i. Several cells on one GPU share its memory: each engine takes its weights plus
`[engine] kv_fraction` of the GPU for decode KV (the config refuses more than 0.8 of a GPU in KV), and
the trainers allocate as they go (PyTorch's caching allocator: what a trainer freed stays reserved in
its process, so size `kv_fraction` for the trainers' peak too).
"""

from __future__ import annotations

from gyre.config.runconfig import Config


def cell_gpus(cfg: Config) -> list[int | None]:
    """The GPU index of each cell (None on the CPU)."""
    if cfg.cell.device != "cuda":
        return [None] * cfg.run.cells
    return list(cfg.cell.gpus) if cfg.cell.gpus else list(range(cfg.run.cells))


def cell_env(cfg: Config, cell_id: int) -> dict[str, str]:
    """Environment of cell `cell_id`'s process (its engine inherits it)."""
    gpu = cell_gpus(cfg)[cell_id]
    if gpu is None:
        return {}
    return {"CUDA_VISIBLE_DEVICES": str(gpu)}


def engine_argv(cfg: Config) -> list[str]:
    """The `gyre-engine serve` options that `[engine]` sets (the cell adds model, port and device)."""
    e = cfg.engine
    argv = [
        "--max-running-requests", str(e.max_running), "--slot-kv-fraction", str(e.kv_fraction),
        "--warmup-decode-tokens", str(e.warmup_tokens), "--decode-slots", e.decode_slots,
    ]  # fmt: skip
    if e.slot_widths:
        argv += ["--slot-widths", e.slot_widths]
    if e.max_cached_tokens:
        argv += ["--max-cached-tokens", str(e.max_cached_tokens)]
    if e.host_cached_tokens:
        argv += ["--host-cached-tokens", str(e.host_cached_tokens)]
    if e.long_context_tokens:
        argv += ["--long-context-tokens", str(e.long_context_tokens)]
    if e.long_context_slots:
        argv += ["--long-context-slots", str(e.long_context_slots)]
    if e.prefill_chunk:
        argv += ["--prefill-chunk", str(e.prefill_chunk)]
    if e.min_free_gib:
        argv += ["--min-free-gib", str(e.min_free_gib)]
    if cfg.cell.device == "cuda":  # cells release and resume their engine's memory at every switch
        argv.append("--pin-host-weights")
    if not e.keep_graphs:
        argv.append("--no-keep-graphs")
    if not e.prefill_graphs:
        argv += ["--prefill-graph-tokens", "0"]
    return [*argv, "--no-compile-decode"] if not e.compile_decode else argv


def sharing(cfg: Config) -> dict[int, list[int]]:
    """GPU index -> the cells on it (empty on the CPU)."""
    out: dict[int, list[int]] = {}
    for i, g in enumerate(cell_gpus(cfg)):
        if g is not None:
            out.setdefault(g, []).append(i)
    return out
