"""Megatron-core backend (extra `gyre-train[megatron]`): a GPTModel built with the local (non-
TransformerEngine) layer spec in the architecture of a `ModelConfig` (Qwen2, Qwen3 or Llama: RMSNorm
epsilon, RoPE base, Qwen2's q/k/v biases, Qwen3's q/k norms, tied or untied embeddings, all from the
config; what it cannot build is refused by `modelconfig.megatron_refusal` when the config is read), run
on tree-packed micro-batches, in one process or split over a cell's ranks with Megatron's tensor and
pipeline parallelism.

Megatron's GPTModel computes rotary embeddings from the sequence index and ignores `position_ids`; tree
packing needs them from tree depth, so `tree_target_logprobs` runs the model's own embedding, decoder and
output layer with rotary frequencies gathered at each token's position id and the ancestor mask as a
boolean attention mask (True = masked). With tensor parallelism the output layer's logits stay split
over the vocabulary and log-probabilities come from Megatron's `vocab_parallel_cross_entropy`; with
pipeline parallelism `pipeline_loss_backward` runs one micro-batch through the stages (Megatron's model
partition and its `P2PCommunicator`; one micro-batch in flight, since a replica claims one at a time).
Weights convert to the transformers layout with `gyre_xfer.convert.megatron_to_hf` (`mplayout.py`
gathers them from the ranks first), and from it with `hf_to_megatron` (a model directory's weights).
One process needs a gloo process group (and, on the CPU, two work-arounds; see `init_cpu`); tested on
the CPU (one and two ranks) and on one H200.
"""

from __future__ import annotations

import os
import socket
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from gyre_traj.loss import TorchBatch

from gyre_train import mplayout
from gyre_train.modelconfig import ModelConfig, megatron_refusal

with warnings.catch_warnings():  # megatron-core warns at import about optional TransformerEngine/Apex/absl
    warnings.simplefilter("ignore")
    try:
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
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


def build_gpt(mc: ModelConfig) -> Any:
    """A GPTModel with the architecture of `mc` (RMSNorm, SwiGLU, GQA, RoPE with the config's theta; the
    family's q/k/v biases and q/k norms), so its weights convert 1:1 to the transformers model; this rank's
    part of it when the model-parallel groups are larger than one (its tensor-parallel shards of its
    pipeline stage's layers)."""
    why = megatron_refusal(mc.arch)
    if why is not None:
        raise ValueError(f"the megatron backend does not build this model: {why}")
    first = parallel_state.is_pipeline_first_stage()
    last = parallel_state.is_pipeline_last_stage()
    if mc.tie_word_embeddings and not (first and last):
        raise ValueError(
            "tied embeddings with pipeline parallelism are not supported (the embedding and output layer "
            "live on different stages and their gradients are not all-reduced here)"
        )
    with warnings.catch_warnings():  # deprecation notes about defaults we do not use (CUDA graphs)
        warnings.simplefilter("ignore")
        cfg = _config(mc)
        return GPTModel(
            config=cfg,
            transformer_layer_spec=get_gpt_layer_local_spec(
                qk_layernorm=mc.arch.qk_norm, normalization="RMSNorm"
            ),
            vocab_size=mc.vocab_size,
            max_sequence_length=mc.max_position_embeddings,
            position_embedding_type="rope",
            rotary_base=mc.arch.rope_theta,  # a float: Megatron computes base ** (2i / d) as transformers does
            share_embeddings_and_output_weights=mc.tie_word_embeddings,
            pre_process=first,
            post_process=last,
        )


def _config(mc: ModelConfig) -> Any:
    dtype = getattr(torch, mc.dtype)
    return TransformerConfig(
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        pipeline_dtype=dtype,
        batch_p2p_comm=False,  # plain isend/irecv: the batched path calls torch.cuda.synchronize()
        num_layers=mc.num_hidden_layers,
        hidden_size=mc.hidden_size,
        ffn_hidden_size=mc.intermediate_size,
        num_attention_heads=mc.num_attention_heads,
        num_query_groups=mc.num_key_value_heads,
        kv_channels=mc.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=mc.arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=mc.arch.qkv_bias,
        qk_layernorm=mc.arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=dtype,
        bf16=mc.dtype == "bfloat16",
        apply_rope_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )


def _tree_mask_and_rope(model: Any, tb: TorchBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The ancestor mask [1, 1, T, T] (True = masked) and rotary embeddings at each token's tree position."""
    pos = tb.position_ids
    freqs = model.rotary_pos_emb(int(pos.max()) + 1)  # [P, 1, 1, D], one row per position
    rot = freqs.index_select(0, pos)  # the fix: rotary embedding from each token's position id
    n = pos.shape[0]
    idx = torch.arange(n, device=pos.device)
    allowed = (idx[None, :] <= idx[:, None]) & (idx[:, None] <= tb.last_desc[None, :])
    return ~allowed[None, None], rot


def _stage_forward(model: Any, tb: TorchBatch, inputs: torch.Tensor | None) -> torch.Tensor:
    """This pipeline stage's hidden states [T, 1, H]: from the embedding on the first stage, else from
    `inputs` (the previous stage's output)."""
    mask, rot = _tree_mask_and_rope(model, tb)
    if inputs is None:
        emb = model.embedding(input_ids=tb.input_ids[None], position_ids=tb.position_ids[None])  # [T, 1, H]
    else:
        model.set_input_tensor(inputs)
        emb = inputs
    return model.decoder(hidden_states=emb, attention_mask=mask, rotary_pos_emb=rot)


def tree_hidden(model: Any, tb: TorchBatch) -> torch.Tensor:
    """Final hidden states [T, H] of a tree-packed batch: ancestor mask, RoPE at tree position ids (a
    model with every layer, i.e. no pipeline parallelism)."""
    return _stage_forward(model, tb, None)[:, 0]


def _logprobs(model: Any, hidden: torch.Tensor, tb: TorchBatch, temperature: float) -> torch.Tensor:
    h = hidden.index_select(0, tb.target_pos)
    logits, _ = model.output_layer(
        h[:, None],
        weight=model.shared_embedding_or_output_weight()
        if model.share_embeddings_and_output_weights
        else None,
    )
    logits = logits.float()  # [L, 1, V] (V / tp on each rank with tensor parallelism)
    if temperature != 1.0:
        logits = logits / temperature
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        return -tensor_parallel.vocab_parallel_cross_entropy(logits, tb.target_ids[:, None])[:, 0]
    return torch.log_softmax(logits[:, 0], -1).gather(1, tb.target_ids[:, None])[:, 0]


def tree_target_logprobs(model: Any, tb: TorchBatch, temperature: float = 1.0) -> torch.Tensor:
    """Log-probabilities [L] of the batch's loss targets (the Megatron twin of gyre-traj's target_logprobs),
    on a model with every layer; with tensor parallelism every rank of the group calls it together."""
    return _logprobs(model, tree_hidden(model, tb), tb, temperature)


def pipeline_loss_backward(model: Any, tb: TorchBatch, loss_cfg: Any) -> dict[str, float]:
    """One micro-batch through this rank's pipeline stage, forward then backward, every stage of the
    group calling it together: the first stage embeds, each stage sends its output to the next
    (Megatron's P2PCommunicator), the last computes gyre-traj's policy loss and starts the backward pass,
    and each stage sends the gradient of its input back. Returns the loss metrics on the last stage, {}
    elsewhere. Without pipeline parallelism it is the plain forward and backward."""
    from gyre_traj.loss import policy_loss

    first = parallel_state.is_pipeline_first_stage()
    last = parallel_state.is_pipeline_last_stage()
    comm = None
    if not (first and last):
        comm = P2PCommunicator(parallel_state.get_pipeline_model_parallel_group(), model.config)
    shape = (int(tb.input_ids.shape[0]), 1, model.config.hidden_size)
    inputs = None if first else comm.recv_forward(shape, is_first_stage=False)  # type: ignore[union-attr]
    hidden = _stage_forward(model, tb, inputs)
    metrics: dict[str, float] = {}
    if last:
        loss, metrics = policy_loss(_logprobs(model, hidden[:, 0], tb, loss_cfg.temperature), tb, loss_cfg)
        loss.backward()
    else:
        assert comm is not None
        comm.send_forward(hidden, is_last_stage=False)
        grad = comm.recv_backward(shape, is_last_stage=False)
        torch.autograd.backward(hidden, grad_tensors=grad)
    if not first:
        assert comm is not None and inputs is not None
        comm.send_backward(inputs.grad, is_first_stage=False)
    return metrics


def finalize_grads(model: Any) -> None:
    """What Megatron's `finalize_model_grads` does for this model, on gradients already in `.grad`:
    sum the q/k layernorm gradients over the tensor-parallel group (each rank saw only its heads)."""
    if parallel_state.get_tensor_model_parallel_world_size() <= 1:
        return
    group = parallel_state.get_tensor_model_parallel_group()
    for name, p in model.named_parameters():
        if p.grad is not None and mplayout.partial_over_tp(name):
            torch.distributed.all_reduce(p.grad, group=group)


def grad_norm_sq(model: Any) -> torch.Tensor:
    """Sum of squared gradients of this rank's parameters, counting a parameter that every tensor-parallel
    rank holds (layer norms) once, in float64; sum it over the model-parallel group for the norm."""
    total = torch.zeros((), dtype=torch.float64, device=next(model.parameters()).device)
    for p in model.parameters():
        if p.grad is not None and tensor_parallel.param_is_not_tensor_parallel_duplicate(p):
            total += p.grad.detach().double().pow(2).sum()
    return total


def hf_state_dict(model: Any, mc: ModelConfig) -> dict[str, Any]:
    """The model's weights in the transformers layout of its family, via gyre-xfer's converter."""
    from gyre_xfer.convert import megatron_to_hf

    src = {
        k: v.detach().cpu().float().numpy()
        for k, v in model.state_dict().items()
        if not k.endswith("_extra_state")
    }
    return dict(megatron_to_hf(mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim)(src))


_HF_PLAIN = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_HF_PER_LAYER = {  # the local layer spec's names (no TransformerEngine fused norms)
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


def hf_to_megatron(hf: Mapping[str, torch.Tensor], mc: ModelConfig) -> dict[str, torch.Tensor]:
    """Transformers-layout weights of `mc`'s family (a model directory's) in the one-rank Megatron-core
    layout `build_gpt` makes: q/k/v (weights and biases) fused per query group (each group's query heads,
    then its key head, then its value head: what `gyre_xfer.convert.split_qkv` splits), gate and up
    fused as [gate; up]. The inverse of `gyre_xfer.convert.megatron_to_hf`; a tensor it has no place for,
    or one it lacks, is an error."""
    heads, groups, hd = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim
    per = heads // groups
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise ValueError(f"the transformers weights lack {name}")
        used.add(name)
        return hf[name]

    for meg, name in _HF_PLAIN.items():
        if meg == "output_layer.weight" and mc.tie_word_embeddings:
            continue
        out[meg] = take(name)
    for i in range(mc.num_hidden_layers):
        pre, src = f"decoder.layers.{i}.", f"model.layers.{i}."
        for meg, name in _HF_PER_LAYER.items():
            if (
                meg.startswith(("self_attention.q_layernorm", "self_attention.k_layernorm"))
                and not mc.arch.qk_norm
            ):
                continue
            out[pre + meg] = take(src + name)
        kinds = ("weight", "bias") if mc.arch.qkv_bias else ("weight",)
        for kind in kinds:
            q = take(f"{src}self_attn.q_proj.{kind}")
            k = take(f"{src}self_attn.k_proj.{kind}")
            v = take(f"{src}self_attn.v_proj.{kind}")
            rest = tuple(q.shape[1:])
            fused = torch.cat(
                [
                    q.reshape(groups, per, hd, *rest),
                    k.reshape(groups, 1, hd, *rest),
                    v.reshape(groups, 1, hd, *rest),
                ],
                dim=1,
            )
            out[f"{pre}self_attention.linear_qkv.{kind}"] = fused.reshape(groups * (per + 2) * hd, *rest)
        out[pre + "mlp.linear_fc1.weight"] = torch.cat(
            [take(src + "mlp.gate_proj.weight"), take(src + "mlp.up_proj.weight")]
        )
    extra = sorted(set(hf) - used)
    if extra:
        raise ValueError(f"no Megatron-core place for {extra[:5]}")
    return out
