"""Tiny random checkpoints of each family gyre-train implements, with non-default values in every field
that changes the forward (RoPE base and scaling, RMSNorm epsilon, biases, untied embeddings), written by
gyre-engine's `create_model` and then given random biases and norm weights (an init leaves those at 0
and 1, where a dropped field or a missing bias would not show)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
CONTEXT = 256
"""max_position_embeddings of every test checkpoint: YaRN's factor is CONTEXT / its original 64."""
FAMILIES: dict[str, dict[str, Any]] = {
    # Qwen2 / Qwen2.5: q/k/v biases always; YaRN as Qwen2.5 documents for long contexts
    "qwen2": {"rope_theta": 1e6, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "rope_scaling": YARN},
    # Qwen3: q/k norms always; attention biases on (q, k, v, o)
    "qwen3": {
        "rope_theta": 1e6,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "attention_bias": True,
        "rope_scaling": YARN,
    },
    # Llama 3.1-style RoPE scaling, biases in attention and MLP, a head_dim other than hidden / heads
    "llama": {
        "rope_theta": 5e5,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "attention_bias": True,
        "mlp_bias": True,
        "head_dim": 32,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
}
"""Per family, the config fields each test checkpoint sets (on gyre-engine's tiny shape)."""


def family_dir(out: Path, family: str, seed: int = 0, **overrides: Any) -> Path:
    """A tiny checkpoint of `family` with `FAMILIES[family]` (and `overrides`) in its config.json."""
    from gyre_engine.server.model_factory import create_model

    fields = {"max_position_embeddings": CONTEXT, **FAMILIES[family], **overrides}
    path = create_model(out, "tiny", seed=seed, family=family, overrides=fields)
    perturb(path, seed)
    return path


def perturb(path: Path, seed: int) -> None:
    """Random biases and norm weights (around 1), so that every one of them changes the logprobs."""
    f = path / "model.safetensors"
    state = load_file(str(f))
    g = torch.Generator().manual_seed(seed + 1)
    for name, t in state.items():
        if name.endswith(".bias"):
            state[name] = torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.dtype) * 0.5
        elif "norm" in name:
            state[name] = (1 + 0.3 * torch.randn(t.shape, generator=g, dtype=torch.float32)).to(t.dtype)
    save_file(state, str(f), metadata={"format": "pt"})


MEGATRON: dict[str, dict[str, Any]] = {
    "qwen2": {"rope_scaling": None},
    "qwen3": {"rope_scaling": None, "attention_bias": False},
    "llama": {"rope_scaling": None, "attention_bias": False, "mlp_bias": False},
}
"""Overrides leaving what the Megatron-core backend builds (no RoPE scaling, no output or MLP biases);
the rest of each family's non-default fields stay (RoPE base, epsilon, untied, q/k/v biases, head_dim)."""
