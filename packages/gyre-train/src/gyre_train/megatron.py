"""Megatron-core backend (extra `gyre-train[megatron]`): a GPTModel built with the local (non-
TransformerEngine) layer spec in the Qwen3 shape of a `ModelConfig`, run on tree-packed micro-batches.

Megatron's GPTModel computes rotary embeddings from the sequence index and ignores `position_ids`; tree
packing needs them from tree depth, so `tree_target_logprobs` runs the model's own embedding, decoder and
output layer with rotary frequencies gathered at each token's position id and the ancestor mask as a
boolean attention mask (True = masked). Weights convert to the transformers layout with
`gyre_xfer.convert.megatron_to_hf`. One process needs a gloo process group (and, on the CPU, two
work-arounds; see `init_cpu`); tested on the CPU and on one H200 (`tests/test_megatron_cuda.py`).
"""

from __future__ import annotations

import os
import socket
import warnings
from typing import Any

import torch
from gyre_traj.loss import TorchBatch

from gyre_train.modelconfig import ModelConfig

with warnings.catch_warnings():  # megatron-core warns at import about optional TransformerEngine/Apex/absl
    warnings.simplefilter("ignore")
    try:
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError as exc:  # pragma: no cover - exercised without the extra
        raise ImportError(
            "gyre_train.megatron needs megatron-core: `pip install 'gyre-train[megatron]'`"
        ) from exc


def init_cpu(seed: int = 0) -> None:
    """One-process gloo group and model-parallel state (idempotent: a process group or model-parallel
    state set up before, e.g. NCCL across GPUs, is kept), for CPU runs and single-GPU runs alike.
    Work-arounds for megatron-core 0.19 on a machine without CUDA: its RNG tracker asks
    `torch.cuda.current_device()` (answered with the CPU there) and needs `inference_rng_tracker=True`."""
    if not torch.distributed.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)


def _rope_theta(mc: ModelConfig) -> float:
    hf = mc.hf_config()
    params = getattr(hf, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))


def build_gpt(mc: ModelConfig) -> Any:
    """A GPTModel with the Qwen3 architecture of `mc` (RMSNorm, SwiGLU, GQA, q/k RMSNorm, RoPE with the
    transformers config's theta, no biases), so its weights convert 1:1 to the transformers model."""
    with warnings.catch_warnings():  # deprecation notes about defaults we do not use (CUDA graphs)
        warnings.simplefilter("ignore")
        cfg = _config(mc)
        return GPTModel(
            config=cfg,
            transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"),
            vocab_size=mc.vocab_size,
            max_sequence_length=mc.max_position_embeddings,
            position_embedding_type="rope",
            rotary_base=int(_rope_theta(mc)),
            share_embeddings_and_output_weights=mc.tie_word_embeddings,
        )


def _config(mc: ModelConfig) -> Any:
    return TransformerConfig(
        num_layers=mc.num_hidden_layers,
        hidden_size=mc.hidden_size,
        ffn_hidden_size=mc.intermediate_size,
        num_attention_heads=mc.num_attention_heads,
        num_query_groups=mc.num_key_value_heads,
        kv_channels=mc.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=getattr(torch, mc.dtype),
        bf16=mc.dtype == "bfloat16",
        apply_rope_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )


def tree_hidden(model: Any, tb: TorchBatch) -> torch.Tensor:
    """Final hidden states [T, H] of a tree-packed batch: ancestor mask, RoPE at tree position ids."""
    ids = tb.input_ids[None]
    pos = tb.position_ids
    emb = model.embedding(input_ids=ids, position_ids=pos[None])  # [T, 1, H]
    freqs = model.rotary_pos_emb(int(pos.max()) + 1)  # [P, 1, 1, D], one row per position
    rot = freqs.index_select(0, pos)  # the fix: rotary embedding from each token's position id
    n = pos.shape[0]
    idx = torch.arange(n, device=pos.device)
    allowed = (idx[None, :] <= idx[:, None]) & (idx[:, None] <= tb.last_desc[None, :])
    hidden = model.decoder(hidden_states=emb, attention_mask=~allowed[None, None], rotary_pos_emb=rot)
    return hidden[:, 0]


def tree_target_logprobs(model: Any, tb: TorchBatch, temperature: float = 1.0) -> torch.Tensor:
    """Log-probabilities [L] of the batch's loss targets (the Megatron twin of gyre-traj's target_logprobs)."""
    h = tree_hidden(model, tb).index_select(0, tb.target_pos)
    logits, _ = model.output_layer(
        h[:, None],
        weight=model.shared_embedding_or_output_weight()
        if model.share_embeddings_and_output_weights
        else None,
    )
    logits = logits[:, 0].float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(1, tb.target_ids[:, None])[:, 0]


def hf_state_dict(model: Any, mc: ModelConfig) -> dict[str, Any]:
    """The model's weights in the transformers (Qwen3) layout, via gyre-xfer's converter."""
    from gyre_xfer.convert import megatron_to_hf

    src = {
        k: v.detach().cpu().float().numpy()
        for k, v in model.state_dict().items()
        if not k.endswith("_extra_state")
    }
    return dict(megatron_to_hf(mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim)(src))
