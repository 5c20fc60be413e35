"""Giving a GPU's idle memory back between training turns.

A trainer shares its GPU with a rollout engine: while the cell trains, the engine has released its KV and
weights and the trainer's activations take that room; when the cell goes back to rollout the engine takes
it again. PyTorch's caching allocator keeps every block a trainer freed reserved in its process, so without
this the engine finds the GPU full (a 16k-token micro-batch of a 0.6B model leaves about 50 GiB reserved).
"""

from __future__ import annotations

import torch


def release_cached_memory() -> int:
    """Return the blocks this process's caching allocator holds but no tensor uses to the driver; the
    bytes given back (0 on a machine where CUDA was never used)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0
    before = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    return max(0, before - torch.cuda.memory_reserved())


def peak_gib_since_last() -> float | None:
    """The most device memory this process's tensors held since the last call (GiB), then the count
    starts again; None without CUDA in use. What the log says beside each micro-batch on a GPU."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    peak = torch.cuda.max_memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    return peak
