"""Export to a Hugging Face model directory: `config.json`, `model.safetensors` and the tokenizer files,
which transformers' `AutoModelForCausalLM.from_pretrained` loads and gyre-engine (or SGLang) serves.

Works from a gyre-train checkpoint directory (`checkpoint.save`: `model.safetensors` + `state.json`
with the model config; Megatron-core checkpoints are converted to the transformers layout with
gyre-xfer's `megatron_to_hf`) or from a live model. `config.json` is the model config's own HF config
written back whole (a directory's as it was read, every field kept; only the dtype set to the weights'),
so the export computes what was trained. A checkpoint holds no tokenizer, so the tokenizer files come
from a model directory given as `tokenizer`, normally the one training started from (and, for a model
trained from scratch, whose config names no special tokens, the special token ids of its config.json).
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
from gyre_train.modelconfig import ModelConfigError

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
    try:
        mc = ModelConfig.from_dict(state["model"])
    except (KeyError, ModelConfigError) as exc:
        raise ExportError(f"{ckpt}/state.json: no model config gyre-train builds: {exc}") from exc
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


def config_json(mc: ModelConfig, tokenizer: Path) -> dict[str, Any]:
    """The exported `config.json`: the model config's HF config, its dtype the weights' (the keys the
    config states it under, `dtype` if none), special token ids it lacks from the tokenizer directory's."""
    out = mc.arch.to_dict()
    keys = [k for k in ("dtype", "torch_dtype") if k in out] or ["dtype"]
    for k in keys:
        out[k] = mc.dtype
    src = tokenizer / "config.json"
    if src.exists():
        base = json.loads(src.read_text())
        for key in SPECIAL_IDS:
            if key not in out and key in base:
                out[key] = base[key]
    return out


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
    config = config_json(model_cfg, tokenizer)
    model = AutoModelForCausalLM.from_config(
        model_cfg.arch.hf_config(), dtype=getattr(torch, model_cfg.dtype)
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
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
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
