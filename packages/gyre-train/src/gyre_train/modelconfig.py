"""What a model is, before it is built: the `ModelConfig` every replica builds the same architecture from
(it travels to satellites as JSON in `Welcome`), and the `Attention` kinds. Imports nothing of torch, so
the backends (`model.py`, `chunked.py`, `megatron.py`) all sit above it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Attention = Literal["dense", "flex"]


@dataclass(frozen=True)
class ModelConfig:
    """A Qwen3-architecture model from scratch (random init with `seed`)."""

    vocab_size: int = 8192
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    max_position_embeddings: int = 1 << 20
    tie_word_embeddings: bool = False
    seed: int = 0
    dtype: str = "float32"
    """Parameter dtype: "float32" or "bfloat16"."""
    backend: str = "transformers"
    """"transformers" (Qwen3ForCausalLM) or "megatron" (megatron-core GPTModel, extra `gyre-train[megatron]`)."""

    def hf_config(self, attention: Attention = "dense") -> Any:
        from transformers import Qwen3Config

        return Qwen3Config(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            attn_implementation="flex_attention" if attention == "flex" else "sdpa",  # type: ignore[call-arg]
        )

    @property
    def family(self) -> str:
        return "qwen3"

    @property
    def architecture(self) -> str:
        return "Qwen3ForCausalLM"

    @staticmethod
    def from_model_dir(path: str | Path, seed: int = 0, dtype: str | None = None) -> ModelConfig:
        """The architecture of a model directory (its config.json's dimensions)."""
        c = json.loads((Path(path) / "config.json").read_text())
        return ModelConfig(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_hidden_layers=c["num_hidden_layers"],
            num_attention_heads=c["num_attention_heads"],
            num_key_value_heads=c["num_key_value_heads"],
            head_dim=c.get("head_dim", c["hidden_size"] // c["num_attention_heads"]),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            seed=seed,
            dtype=dtype or str(c.get("dtype") or c.get("torch_dtype") or "float32"),
        )

    def to_json(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> ModelConfig:
        return ModelConfig(**json.loads(text))


class ModelConfigError(ValueError):
    """A model directory's config that gyre-train cannot build exactly (names the field)."""
