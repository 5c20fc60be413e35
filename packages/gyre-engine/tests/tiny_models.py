"""A Qwen3 model small enough to build in memory for a test: the model's modules, not its quality."""

from __future__ import annotations

from typing import Any

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM


def tiny_qwen3() -> Any:
    """Two layers of 4 query and 2 key/value heads of 8, a vocabulary of 64, seeded weights."""
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    return Qwen3ForCausalLM(cfg).eval()
