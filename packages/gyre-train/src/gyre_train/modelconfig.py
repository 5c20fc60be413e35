"""What a model is, before it is built: the `ModelConfig` every replica builds the same model from (an
`Architecture`, i.e. a model directory's whole HF config or the embedded default's Qwen3 from scratch,
plus the training seed, dtype and backend). It travels to satellites and into checkpoints as JSON
(`to_json`, format 2; format 1, the flat from-scratch fields of earlier releases, still reads). Imports
nothing of torch, so the backends (`model.py`, `chunked.py`, `megatron.py`) all sit above it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from gyre_train.architecture import Architecture, Attention, ModelConfigError

__all__ = ["Architecture", "Attention", "ModelConfig", "ModelConfigError", "Scratch"]

FORMAT = 2
"""`to_dict` layout: 2 = {"format", "hf", "seed", "dtype", "backend"}; 1 (no "format" key) = the flat
`Scratch` fields with seed, dtype and backend."""
DTYPES = ("float32", "bfloat16")
BACKENDS = ("transformers", "megatron")


@dataclass(frozen=True)
class Scratch:
    """A Qwen3 trained from random init: the embedded default's dimensions (`ModelConfig(**fields)`)."""

    vocab_size: int = 8192
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    max_position_embeddings: int = 1 << 20
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    def hf(self) -> dict[str, Any]:
        """The whole HF config dict of this model (every field the forward reads stated, so no
        transformers default can change it)."""
        return {
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
            **asdict(self),
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "initializer_range": 0.02,
        }


@dataclass(frozen=True, init=False)
class ModelConfig:
    """`ModelConfig.from_model_dir(path)` for a model directory, `ModelConfig(**Scratch fields)` (or no
    arguments: the embedded default) for a Qwen3 from scratch, `ModelConfig(arch, **Scratch fields)` for
    `arch` with those fields changed. Random init uses `seed` either way (a directory's weights are loaded
    after, `model.load_pretrained`)."""

    arch: Architecture
    """What the model computes (the whole HF config)."""
    seed: int = 0
    dtype: str = "float32"
    """Parameter dtype: "float32" or "bfloat16"."""
    backend: str = "transformers"
    """"transformers" (the family's transformers class) or "megatron" (megatron-core GPTModel, extra
    `gyre-train[megatron]`; `megatron_refusal` says what it does not build)."""

    def __init__(
        self,
        arch: Architecture | Mapping[str, Any] | None = None,
        *,
        seed: int = 0,
        dtype: str = "float32",
        backend: str = "transformers",
        **scratch: Any,
    ) -> None:
        if arch is None:
            arch = Architecture(Scratch(**scratch).hf())
        else:
            if not isinstance(arch, Architecture):
                arch = Architecture(arch)
            if scratch:  # `dataclasses.replace(mc, hidden_size=...)`: those fields of the dict changed
                unknown = set(scratch) - {f.name for f in fields(Scratch)}
                if unknown:
                    raise TypeError(
                        f"ModelConfig got unknown fields {sorted(unknown)} (Scratch's are settable)"
                    )
                arch = Architecture({**arch.to_dict(), **scratch})
        if dtype not in DTYPES:
            raise ModelConfigError(f"dtype {dtype!r}: gyre-train trains in {' or '.join(DTYPES)}")
        if backend not in BACKENDS:
            raise ModelConfigError(f"unknown backend {backend!r}: use 'transformers' or 'megatron'")
        if backend == "megatron":
            why = megatron_refusal(arch)
            if why is not None:
                raise ModelConfigError(f"the megatron backend does not build this model: {why}")
        for name, value in (("arch", arch), ("seed", int(seed)), ("dtype", dtype), ("backend", backend)):
            object.__setattr__(self, name, value)

    # ------------------------------------------------------------------ reading
    @staticmethod
    def from_model_dir(
        path: str | Path, *, seed: int = 0, dtype: str | None = None, backend: str = "transformers"
    ) -> ModelConfig:
        """The model of a directory's `config.json` (checked: a `ModelConfigError` names what gyre-train
        does not build exactly); `dtype` None trains in the checkpoint's dtype."""
        f = Path(path) / "config.json"
        try:
            d = json.loads(f.read_text())
        except OSError as exc:
            raise ModelConfigError(f"{f}: cannot read it ({exc.strerror or exc})") from exc
        except ValueError as exc:
            raise ModelConfigError(f"{f}: not JSON ({exc})") from exc
        if not isinstance(d, dict):
            raise ModelConfigError(f"{f}: not a JSON object")
        arch = Architecture(d, where=str(f))
        if dtype is None:
            dtype = arch.checkpoint_dtype or "float32"
            if dtype not in DTYPES:
                raise ModelConfigError(
                    f"{f}: the weights are {dtype}; gyre-train trains in {' or '.join(DTYPES)}: pass dtype"
                )
        return ModelConfig(arch, seed=seed, dtype=dtype, backend=backend)

    def hf_config(self, attention: Attention = "dense") -> Any:
        """The transformers config the model is built from (`Architecture.hf_config`)."""
        return self.arch.hf_config(attention)

    # ------------------------------------------------------------------ the architecture's fields
    @property
    def family(self) -> str:
        return self.arch.family

    @property
    def architecture(self) -> str:
        return self.arch.architecture

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.arch.hidden_size

    @property
    def intermediate_size(self) -> int:
        return self.arch.intermediate_size

    @property
    def num_hidden_layers(self) -> int:
        return self.arch.num_hidden_layers

    @property
    def num_attention_heads(self) -> int:
        return self.arch.num_attention_heads

    @property
    def num_key_value_heads(self) -> int:
        return self.arch.num_key_value_heads

    @property
    def head_dim(self) -> int:
        return self.arch.head_dim

    @property
    def max_position_embeddings(self) -> int:
        return self.arch.max_position_embeddings

    @property
    def tie_word_embeddings(self) -> bool:
        return self.arch.tie_word_embeddings

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "hf": self.arch.to_dict(),
            "seed": self.seed,
            "dtype": self.dtype,
            "backend": self.backend,
        }

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> ModelConfig:
        """Format 2, or format 1 (an earlier release's flat from-scratch fields, in old checkpoints)."""
        fmt = d.get("format", 1)
        if fmt == 1:
            names = {f.name for f in fields(Scratch)}
            unknown = set(d) - names - {"seed", "dtype", "backend"}
            if unknown:
                raise ModelConfigError(f"model config (format 1): unknown fields {sorted(unknown)}")
            return ModelConfig(**dict(d))
        if fmt != FORMAT:
            raise ModelConfigError(f"model config format {fmt!r}; this release reads 1 and {FORMAT}")
        unknown = set(d) - {"format", "hf", "seed", "dtype", "backend"}
        if unknown or not isinstance(d.get("hf"), dict):
            raise ModelConfigError(
                f"model config (format 2): needs an 'hf' object; unknown fields {sorted(unknown)}"
            )
        return ModelConfig(
            Architecture(d["hf"], where="model config 'hf'"),
            seed=int(d.get("seed", 0)),
            dtype=str(d.get("dtype", "float32")),
            backend=str(d.get("backend", "transformers")),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> ModelConfig:
        try:
            d = json.loads(text)
        except ValueError as exc:
            raise ModelConfigError(f"model config is not JSON: {exc}") from exc
        if not isinstance(d, dict):
            raise ModelConfigError("model config is not a JSON object")
        return ModelConfig.from_dict(d)


def megatron_refusal(arch: Architecture) -> str | None:
    """What `gyre_train.megatron.build_gpt` cannot build faithfully for `arch`, naming the field (None:
    it builds it). It builds RMSNorm with the config's epsilon, SwiGLU, grouped-query attention with
    `head_dim` channels, q/k biases as Qwen2 has them, Qwen3's q/k norms, RoPE of the config's theta, tied
    or untied embeddings; it converts its weights to transformers' names with gyre-xfer's converter."""
    if arch.rope["rope_type"] != "default":
        return f"rope_scaling.rope_type = {arch.rope['rope_type']!r} (only unscaled RoPE)"
    if arch.hidden_act != "silu":
        return f"hidden_act = {arch.hidden_act!r} (only silu: SwiGLU)"
    if arch.o_bias:
        return "attention_bias = true (a bias on the output projection; only Qwen2's q/k/v biases)"
    if arch.mlp_bias:
        return "mlp_bias = true (only bias-free MLPs)"
    return None
