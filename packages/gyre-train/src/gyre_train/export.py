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
from safetensors.torch import load_file, save_file

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
MAX_SHARD_BYTES = 5 * 2**30
"""The largest weight file an export writes (transformers' own default shard size); a larger model is
sharded."""
INDEX = "model.safetensors.index.json"


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
    model_cfg: ModelConfig,
    weights: Mapping[str, torch.Tensor],
    out: Path,
    tokenizer: Path,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Write `weights` (transformers names) as a model directory at `out`, with `tokenizer`'s files.

    The weights are checked by name and shape against the model transformers builds from the config, on
    the meta device (no memory, no random initialisation: building a 0.6B model for real took 10-40 s),
    and written as they are, cast to the config's dtype: `model.safetensors`, or shards of at most
    `max_shard_bytes` with `model.safetensors.index.json` for a larger model."""
    from transformers import AutoModelForCausalLM

    tokenizer, out = Path(tokenizer), Path(out)
    if not (tokenizer / "tokenizer.json").exists():
        raise ExportError(
            f"{tokenizer} has no tokenizer.json: give the model directory training started from"
        )
    config = config_json(model_cfg, tokenizer)
    dtype = getattr(torch, model_cfg.dtype)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_cfg.arch.hf_config(), dtype=dtype)
    params = dict(model.named_parameters())  # a tied lm_head once, as the embedding
    every = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    expected = {**params, **{n: t for n, t in model.state_dict().items() if n not in every}}  # + buffers
    missing = set(expected) - set(weights)
    extra = set(weights) - every - set(expected) - {"lm_head.weight"}
    if missing or extra:
        raise ExportError(
            f"weights do not fit the model: missing {sorted(missing)[:5]}, extra {sorted(extra)[:5]}"
        )
    shapes = [f"{n} {tuple(weights[n].shape)} for {tuple(t.shape)}" for n, t in expected.items()
              if weights[n].shape != t.shape]  # fmt: skip
    if shapes:
        raise ExportError(f"weights do not fit the model: shapes {shapes[:5]}")
    out.mkdir(parents=True, exist_ok=True)
    write_weights(
        {n: weights[n].detach().to("cpu", dtype).contiguous() for n in expected}, out, max_shard_bytes
    )
    if model.can_generate():
        model.generation_config.save_pretrained(out)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in TOKENIZER_FILES:
        if (tokenizer / name).exists():
            shutil.copyfile(tokenizer / name, out / name)
    return out


def write_weights(tensors: Mapping[str, torch.Tensor], out: Path, max_shard_bytes: int) -> None:
    """`tensors` into `out` as transformers reads them: one `model.safetensors` when they fit
    `max_shard_bytes`, else `model-0000k-of-0000n.safetensors` shards in name order (a tensor larger than
    the bound gets a shard of its own) and `model.safetensors.index.json`. Weight files of an earlier
    export in `out` are removed first, so no stale shard is read beside the new ones."""
    for old in [*out.glob("model*.safetensors"), out / INDEX]:
        old.unlink(missing_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    for name in sorted(tensors):
        n = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += n
        total += n
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata=meta)
        return
    weight_map: dict[str, str] = {}
    for k, shard in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata=meta)
        weight_map.update(dict.fromkeys(shard, fname))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def export_checkpoint(ckpt: Path, out: Path, tokenizer: Path) -> Path:
    """`gyre-train export CKPT OUT --tokenizer DIR`: a checkpoint as a model directory."""
    mc, weights, state = read_checkpoint(ckpt)
    path = export_model(mc, weights, out, tokenizer)
    (path / "gyre_export.json").write_text(
        json.dumps({"checkpoint": str(ckpt), "step": state["step"], "version": state["version"]}) + "\n"
    )
    return path
