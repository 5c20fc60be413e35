"""Export to a Hugging Face model directory: `config.json`, `model.safetensors` and the tokenizer files,
which transformers' `AutoModelForCausalLM.from_pretrained` loads and gyre-engine (or SGLang) serves.

Works from a gyre-train checkpoint directory (`checkpoint.save`: `model.safetensors` + `state.json`
with the model config; Megatron-core checkpoints are converted to the transformers layout with
gyre-xfer's `megatron_to_hf`) or from a live model. A checkpoint holds no tokenizer, so the tokenizer
files (and the special token ids for `config.json`) come from a model directory given as `tokenizer`,
normally the one training started from.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from gyre_train.model import ModelConfig

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)
"""Copied from the tokenizer directory when present (the chat template and stop ids go with them)."""
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


class ExportError(ValueError):
    """The checkpoint or tokenizer directory cannot make a model directory (says what is missing)."""


def read_checkpoint(ckpt: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """The model config, the weights in the transformers layout and the state of a checkpoint."""
    ckpt = Path(ckpt)
    try:
        state = json.loads((ckpt / "state.json").read_text())
        weights = load_file(str(ckpt / "model.safetensors"))
    except (OSError, ValueError) as exc:
        raise ExportError(
            f"{ckpt} is not a gyre-train checkpoint (state.json, model.safetensors): {exc}"
        ) from exc
    mc = ModelConfig(**state["model"])
    if mc.backend == "megatron":
        weights = _from_megatron(weights, mc)
    return mc, weights, state


def _from_megatron(weights: Mapping[str, torch.Tensor], mc: ModelConfig) -> dict[str, torch.Tensor]:
    from gyre_xfer.convert import megatron_to_hf

    convert = megatron_to_hf(mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim)
    dtypes = {n: t.dtype for n, t in weights.items()}
    arrays = convert({n: t.float().numpy() for n, t in weights.items()})
    dtype = next(iter(dtypes.values()))
    return {n: torch.from_numpy(a).to(dtype) for n, a in arrays.items()}


def _hf_config(mc: ModelConfig, tokenizer: Path) -> Any:
    cfg = mc.hf_config()
    src = tokenizer / "config.json"
    if src.exists():
        base = json.loads(src.read_text())
        for key in (*SPECIAL_IDS, "max_position_embeddings", "rope_theta", "rms_norm_eps"):
            if key in base:
                setattr(cfg, key, base[key])
    cfg.dtype = mc.dtype
    return cfg


def export_model(
    model_cfg: ModelConfig, weights: Mapping[str, torch.Tensor], out: Path, tokenizer: Path
) -> Path:
    """Write `weights` (transformers names) as a model directory at `out`, with `tokenizer`'s files."""
    from transformers import AutoModelForCausalLM

    tokenizer, out = Path(tokenizer), Path(out)
    if not (tokenizer / "tokenizer.json").exists():
        raise ExportError(
            f"{tokenizer} has no tokenizer.json: give the model directory training started from"
        )
    model = AutoModelForCausalLM.from_config(
        _hf_config(model_cfg, tokenizer), dtype=getattr(torch, model_cfg.dtype)
    )
    expected = {n for n, _ in model.named_parameters()}
    missing = expected - set(weights)
    extra = set(weights) - {n for n, _ in model.named_parameters(remove_duplicate=False)} - {"lm_head.weight"}
    if missing or extra:
        raise ExportError(
            f"weights do not fit the model: missing {sorted(missing)[:5]}, extra {sorted(extra)[:5]}"
        )
    model.load_state_dict(dict(weights), strict=False)
    model.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer / name).exists():
            shutil.copyfile(tokenizer / name, out / name)
    return out


def export_checkpoint(ckpt: Path, out: Path, tokenizer: Path) -> Path:
    """`gyre-train export CKPT OUT --tokenizer DIR`: a checkpoint as a model directory."""
    mc, weights, state = read_checkpoint(ckpt)
    path = export_model(mc, weights, out, tokenizer)
    (path / "gyre_export.json").write_text(
        json.dumps({"checkpoint": str(ckpt), "step": state["step"], "version": state["version"]}) + "\n"
    )
    return path
