"""Giving a GPU's idle memory back between training turns.

A trainer shares its GPU with a rollout engine: while the cell trains, the engine has released its KV and
weights and the trainer's activations take that room; when the cell goes back to rollout the engine takes
it again. PyTorch's caching allocator keeps every block a trainer freed reserved in its process, so without
this the engine finds the GPU full (a 16k-token micro-batch of a 0.6B model leaves about 50 GiB reserved).
"""

from __future__ import annotations

import os

import torch

ALLOC_CONF = "expandable_segments:True"
"""The CUDA caching allocator's setting for a trainer process unless PYTORCH_CUDA_ALLOC_CONF is set. With
fixed-size segments, a trainer's chunks of different sizes leave blocks reserved that no tensor of the next
size fits: on the H200 a trainer beside a serving engine ran out of memory asking for 1.2 GiB while it
held 8.4 GiB reserved and unused. Expandable segments map and unmap pages instead."""


def use_expandable_segments() -> bool:
    """Give this process's allocator `ALLOC_CONF` unless PYTORCH_CUDA_ALLOC_CONF (or PYTORCH_ALLOC_CONF)
    is set; whether it did. Set on the allocator, not in the environment, so the engine processes a cell
    starts keep their own settings (an SGLang engine's memory saver has its own). A trainer shares no
    memory over CUDA IPC, which expandable segments would not allow."""
    if any(os.environ.get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")):
        return False
    if not torch.cuda.is_available():
        return False
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # older builds: the CUDA call
    (setter or torch.cuda.memory._set_allocator_settings)(ALLOC_CONF)
    return True


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
