"""Layout conversion on the way in: a Megatron-core GPT state dict (fused QKV, fused gate/up) to the
transformers Qwen/Llama layout, as a `Converter` for `Subscriber.pull(convert=...)` or `WeightLoader`.

Megatron's fused QKV weight is [groups * (heads/groups + 2) * head_dim, hidden], grouped per KV head:
each group's query heads, then its key head, then its value head. Unknown names are an error, not dropped.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import numpy as np

from .errors import ShapeMismatchError

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_PLAIN = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_PER_LAYER = {
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


def split_qkv(
    fused: np.ndarray, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split Megatron's fused QKV (weight [rows, hidden] or bias [rows]) into q, k, v (contiguous)."""
    per = num_heads // num_kv_heads
    rows = num_kv_heads * (per + 2) * head_dim
    if num_heads % num_kv_heads or fused.shape[0] != rows:
        raise ShapeMismatchError(
            f"fused QKV has {fused.shape[0]} rows; {num_heads} heads in {num_kv_heads} groups of "
            f"head_dim {head_dim} need {rows}"
        )
    g = fused.reshape(num_kv_heads, per + 2, head_dim, *fused.shape[1:])
    q = np.ascontiguousarray(g[:, :per]).reshape(num_heads * head_dim, *fused.shape[1:])
    k = np.ascontiguousarray(g[:, per]).reshape(num_kv_heads * head_dim, *fused.shape[1:])
    v = np.ascontiguousarray(g[:, per + 1]).reshape(num_kv_heads * head_dim, *fused.shape[1:])
    return q, k, v


def megatron_to_hf(
    num_heads: int, num_kv_heads: int, head_dim: int
) -> Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]:
    """A Converter from Megatron-core GPT names and layouts to transformers' (Qwen2/Qwen3/Llama)."""

    def convert(src: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        unknown = []
        for name, arr in src.items():
            if name in _PLAIN:
                out[_PLAIN[name]] = arr
                continue
            m = _LAYER.fullmatch(name)
            if m is None:
                unknown.append(name)
                continue
            i, rest = m.groups()
            pre = f"model.layers.{i}."
            if rest in _PER_LAYER:
                out[pre + _PER_LAYER[rest]] = arr
            elif rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
                kind = rest.rsplit(".", 1)[1]
                q, k, v = split_qkv(arr, num_heads, num_kv_heads, head_dim)
                out[f"{pre}self_attn.q_proj.{kind}"] = q
                out[f"{pre}self_attn.k_proj.{kind}"] = k
                out[f"{pre}self_attn.v_proj.{kind}"] = v
            elif rest == "mlp.linear_fc1.weight":  # SwiGLU: gate rows, then up rows
                half = arr.shape[0] // 2
                out[f"{pre}mlp.gate_proj.weight"] = arr[:half]
                out[f"{pre}mlp.up_proj.weight"] = arr[half:]
            else:
                unknown.append(name)
        if unknown:
            raise ShapeMismatchError(f"no transformers name for Megatron tensors {sorted(unknown)[:8]}")
        return out

    return convert
