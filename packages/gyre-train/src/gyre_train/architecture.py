"""A model's architecture as its Hugging Face `config.json` states it, checked against the dense families
gyre-train trains exactly: Qwen2 (Qwen2.5 is the same architecture), Qwen3 and Llama. The whole dict is
kept: the trainer builds its model from it, it travels to satellites, and export writes it back.
Whatever the trainer could not compute as the engine does (another architecture, a quantized or
multimodal checkpoint, sliding windows, length-dependent RoPE, attention dropout) is refused when the
dict is read, by a `ModelConfigError` that names the field. Imports neither torch nor transformers at
import time; transformers builds the config object with the `from_dict` that `from_pretrained` uses, so
the trainer and the engine read every field the same way.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import cached_property
from typing import Any, Literal

FAMILIES: dict[str, str] = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
}
"""`model_type` -> the one `architectures` entry gyre-train builds for it."""
EXACT_ROPE = ("default", "linear", "llama3", "yarn")
"""RoPE types whose frequencies follow from the config alone, so a token's rotation depends only on its
position id. "dynamic" and "longrope" rescale with the longest sequence in the batch, which a tree-packed
micro-batch (or an engine's batch of rows) does not share with the sequence run alone."""
MULTIMODAL_KEYS = ("text_config", "vision_config", "audio_config")

Attention = Literal["dense", "flex"]
"""The attention a model is built with: SDPA over a dense ancestor mask (CPU), or FlexAttention (GPU)."""
Kernel = Literal["dense", "flex", "tree"]
"""The attention one micro-batch is computed with: a model's `Attention`, or "tree" (`gyre_train.treeattn`:
flash attention over runs of the tree, no mask, nothing compiled), which a model built for FlexAttention
switches to for a micro-batch up to a size, whole or in chunks (`gyre_train.model.chunk_attention`)."""
ChunkMemory = Literal["auto", "kept", "layers", "layers-host"]
"""How a tree larger than the chunk budget is trained (`CoreConfig.chunk_memory`; see `layered.py`)."""


class ModelConfigError(ValueError):
    """A model config gyre-train cannot build exactly; the message names the field (and the file)."""


class Architecture:
    """One checked HF config dict (immutable; equal when the dicts are). Read its fields through the
    properties, which are transformers' reading of the dict (defaults included)."""

    def __init__(self, config: Mapping[str, Any], where: str = "config") -> None:
        try:
            self._text = json.dumps(dict(config), sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ModelConfigError(f"{where}: not a JSON object of finite values ({exc})") from exc
        _check_dict(json.loads(self._text), where)
        _check_built(self, where)

    # ------------------------------------------------------------------ the dict
    def to_dict(self) -> dict[str, Any]:
        """A copy of the whole config dict."""
        return dict(json.loads(self._text))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Architecture) and other._text == self._text

    def __hash__(self) -> int:
        return hash(self._text)

    def __repr__(self) -> str:
        return f"Architecture({self.family}, {self.num_hidden_layers} layers of {self.hidden_size})"

    @cached_property
    def family(self) -> str:
        """`model_type`: qwen2, qwen3 or llama."""
        return str(json.loads(self._text)["model_type"])

    @property
    def architecture(self) -> str:
        """The transformers class the family builds (e.g. Qwen3ForCausalLM)."""
        return FAMILIES[self.family]

    def hf_config(self, attention: Attention | None = None) -> Any:
        """A new transformers config object of the dict (with the attention implementation of `attention`:
        "dense" = SDPA with a 4D mask, "flex" = FlexAttention)."""
        from transformers import CONFIG_MAPPING

        kw = {} if attention is None else {"attn_implementation": HF_ATTENTION[attention]}
        return CONFIG_MAPPING[self.family].from_dict(self.to_dict(), **kw)

    @cached_property
    def _hf(self) -> Any:
        return self.hf_config()

    # ------------------------------------------------------------------ what the forward reads
    @property
    def vocab_size(self) -> int:
        return int(self._hf.vocab_size)

    @property
    def hidden_size(self) -> int:
        return int(self._hf.hidden_size)

    @property
    def intermediate_size(self) -> int:
        return int(self._hf.intermediate_size)

    @property
    def num_hidden_layers(self) -> int:
        return int(self._hf.num_hidden_layers)

    @property
    def num_attention_heads(self) -> int:
        return int(self._hf.num_attention_heads)

    @property
    def num_key_value_heads(self) -> int:
        return int(getattr(self._hf, "num_key_value_heads", None) or self.num_attention_heads)

    @property
    def head_dim(self) -> int:
        """As the families' attention reads it: `head_dim`, else hidden_size / num_attention_heads."""
        return int(getattr(self._hf, "head_dim", None) or self.hidden_size // self.num_attention_heads)

    @property
    def max_position_embeddings(self) -> int:
        return int(self._hf.max_position_embeddings)

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(self._hf.tie_word_embeddings)

    @property
    def rms_norm_eps(self) -> float:
        return float(self._hf.rms_norm_eps)

    @property
    def hidden_act(self) -> str:
        return str(self._hf.hidden_act)

    @property
    def rope(self) -> dict[str, Any]:
        """RoPE parameters: `rope_type`, `rope_theta` and the type's own (factor, ...)."""
        return _rope(self._hf)

    @property
    def rope_theta(self) -> float:
        return float(self.rope["rope_theta"])

    @property
    def qkv_bias(self) -> bool:
        """Biases on the q, k and v projections (always in Qwen2; `attention_bias` in Qwen3 and Llama)."""
        return self.family == "qwen2" or bool(getattr(self._hf, "attention_bias", False))

    @property
    def o_bias(self) -> bool:
        """A bias on the output projection (`attention_bias` in Qwen3 and Llama; never in Qwen2)."""
        return self.family != "qwen2" and bool(getattr(self._hf, "attention_bias", False))

    @property
    def mlp_bias(self) -> bool:
        """Biases on the MLP's projections (Llama's `mlp_bias`)."""
        return self.family == "llama" and bool(getattr(self._hf, "mlp_bias", False))

    @property
    def qk_norm(self) -> bool:
        """RMSNorm on each head's queries and keys (Qwen3)."""
        return self.family == "qwen3"

    @property
    def checkpoint_dtype(self) -> str | None:
        """The dtype the checkpoint's weights are stored in (`dtype`, or `torch_dtype`), if stated."""
        d = json.loads(self._text)
        v = d.get("dtype") or d.get("torch_dtype")
        return None if v is None else str(v).removeprefix("torch.")


HF_ATTENTION = {"dense": "sdpa", "flex": "flex_attention", "tree": "gyre_tree"}
"""transformers' `attn_implementation` of each `Kernel`."""


def _refuse(where: str, field: str, value: Any, why: str) -> ModelConfigError:
    return ModelConfigError(f"{where}: {field} = {json.dumps(value)}: {why}")


def _check_dict(d: dict[str, Any], where: str) -> None:
    """The checks on the dict as written (before transformers reads it)."""
    mt = d.get("model_type")
    if mt not in FAMILIES:
        raise _refuse(
            where,
            "model_type",
            mt,
            "gyre-train builds the dense families qwen2 (Qwen2, Qwen2.5), qwen3 and llama; mixture-of-experts, "
            "multimodal and other architectures are refused",
        )
    archs = d.get("architectures")
    if archs is not None and archs != [FAMILIES[mt]]:
        raise _refuse(
            where,
            "architectures",
            archs,
            f"gyre-train builds {FAMILIES[mt]} for model_type {mt!r}, a causal LM",
        )
    for key in MULTIMODAL_KEYS:
        if key in d:
            raise ModelConfigError(
                f"{where}: {key} is set: a multimodal config (gyre-train builds text-only LMs)"
            )
    if d.get("quantization_config") is not None:
        raise _refuse(
            where,
            "quantization_config",
            d["quantization_config"].get("quant_method", "?")
            if isinstance(d["quantization_config"], dict)
            else "?",
            "quantized weights: gyre-train trains the unquantized model (the engine would serve another forward)",
        )
    if d.get("use_sliding_window"):
        raise _refuse(
            where,
            "use_sliding_window",
            d["use_sliding_window"],
            "sliding-window attention is not implemented in gyre-train's tree-packed forward (full attention only)",
        )
    if float(d.get("attention_dropout") or 0.0) != 0.0:
        raise _refuse(
            where,
            "attention_dropout",
            d["attention_dropout"],
            "dropout makes the trainer's logprobs random; gyre-train recomputes the engine's exactly (0 only)",
        )


def _rope(cfg: Any) -> dict[str, Any]:
    """RoPE parameters of a transformers config (5.x: `rope_parameters`; 4.x: `rope_theta` + `rope_scaling`)."""
    rp = getattr(cfg, "rope_parameters", None)
    if isinstance(rp, dict) and rp:
        out = dict(rp)
    else:
        out = dict(getattr(cfg, "rope_scaling", None) or {})
        out["rope_theta"] = float(getattr(cfg, "rope_theta", 10000.0))
    out["rope_type"] = out.get("rope_type", out.get("type", "default"))
    return out


def _check_built(arch: Architecture, where: str) -> None:
    """The checks on transformers' reading of the dict (its defaults and legacy keys resolved)."""
    d = arch.to_dict()
    try:
        cfg = arch._hf
    except (TypeError, ValueError, KeyError) as exc:
        raise ModelConfigError(
            f"{where}: transformers cannot read it as a {arch.family} config: {exc}"
        ) from exc
    rope = _rope(cfg)
    if any(isinstance(v, dict) for v in rope.values()):
        raise _refuse(where, "rope_parameters", rope, "per-layer-type RoPE parameters are not implemented")
    if rope["rope_type"] not in EXACT_ROPE:
        field = "rope_scaling" if d.get("rope_scaling") else "rope_parameters"
        raise _refuse(
            where,
            f"{field}.rope_type",
            rope["rope_type"],
            f"gyre-train implements {', '.join(EXACT_ROPE)}; this type rescales with the length of the batch's "
            "longest sequence, so a tree-packed batch would not give each path's logprobs",
        )
    from transformers.activations import ACT2CLS

    if arch.hidden_act not in ACT2CLS:
        raise _refuse(where, "hidden_act", arch.hidden_act, "not an activation transformers knows")
    types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"}:
        raise _refuse(where, "layer_types", sorted(types), "only full attention is implemented")
    for key in ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size", "intermediate_size"):
        if int(getattr(cfg, key, 0) or 0) < 1:
            raise _refuse(where, key, d.get(key), "must be a positive integer")
    if arch.num_attention_heads % arch.num_key_value_heads:
        raise _refuse(
            where,
            "num_key_value_heads",
            arch.num_key_value_heads,
            f"must divide num_attention_heads ({arch.num_attention_heads})",
        )
