"""The plain-torch backend: a transformers causal LM, its flat parameter layout, and one micro-batch's
gradient as a flat float32 array.

`micro_gradient` is the only place a replica computes: zero the grads, run gyre-traj's `target_logprobs`
and `policy_loss` on one tree-packed micro-batch, backward, and copy the gradients into one contiguous
vector in `Layout` order, float32 or the wire dtype (a tensor on any device: the core keeps it on its
own device, a satellite on a GPU copies it straight into its page-locked gradient staging, rounding to
bf16 on the way if that is the wire dtype). The core sums those vectors in micro-batch order, so who
computed which micro-batch cannot change the result.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gyre_traj.loss import LossConfig, TorchBatch, policy_loss, target_logprobs_entropy
from gyre_traj.pack import PackedBatch

from gyre_train.architecture import HF_ATTENTION, ChunkMemory, Kernel
from gyre_train.defaults import CHUNK_MEMORY, TREE_CHUNK_ELEMENTS
from gyre_train.layoutdigest import layout_digest
from gyre_train.modelconfig import Attention, ModelConfig

__all__ = [
    "FLEX_RECOMPILE_LIMIT",
    "Attention",
    "ChunkMemory",
    "Layout",
    "ModelConfig",
    "allow_flex_recompiles",
    "attention_implementation",
    "attention_kernels",
    "build_model",
    "chunk_attention",
    "load_params",
    "load_pretrained",
    "micro_gradient",
    "params",
    "pretrained_weights",
    "set_gradients",
    "target_logprobs_of",
]


def build_model(cfg: ModelConfig, attention: Attention = "dense", device: str = "cpu") -> torch.nn.Module:
    """The model of `cfg`, randomly initialised with its seed, in training mode: the family's transformers
    class (Qwen2ForCausalLM, Qwen3ForCausalLM, LlamaForCausalLM) built from the whole HF config, or a
    Megatron-core GPTModel of the same architecture. `load_pretrained` then loads a directory's weights."""
    from transformers import AutoModelForCausalLM

    if cfg.backend == "megatron":
        from gyre_train import megatron

        megatron.init_cpu(cfg.seed)  # one-process group and RNG tracker unless already set up
        torch.manual_seed(cfg.seed)
        return megatron.build_gpt(cfg).to(device).train()
    torch.manual_seed(cfg.seed)
    if attention == "flex":
        allow_flex_recompiles()
    with torch.device(device):  # initialise in place: a 1.5B model is not built on the CPU first
        model = AutoModelForCausalLM.from_config(cfg.hf_config(attention), dtype=getattr(torch, cfg.dtype))
    return model.train()


FLEX_RECOMPILE_LIMIT = 64
"""Graphs torch.compile may keep for one function (FlexAttention's). Its default of 8 is close to what a
run meets: counted on the CPU (forward only, dynamo's guards), 15 chunks and 12 whole micro-batches of
different lengths made 7 graphs (static shapes, then dynamic ones, chunks over ancestors or not, block
masks with and without full blocks), and with autograd a GPU run has as many again. Past the limit torch
runs FlexAttention unfused, every score materialised (quadratic memory and time), so a run that reaches
even this many stops with an error instead."""


def allow_flex_recompiles() -> None:
    """Raise torch.compile's per-function graph limit to `FLEX_RECOMPILE_LIMIT` (never lower it) and make
    reaching it an error rather than a silent fall back to the unfused FlexAttention (process-wide)."""
    import torch._dynamo.config as dynamo

    for name in ("recompile_limit", "cache_size_limit"):  # the newer name first
        if hasattr(dynamo, name):
            setattr(dynamo, name, max(int(getattr(dynamo, name)), FLEX_RECOMPILE_LIMIT))
            break
    for name in ("accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(dynamo, name):
            setattr(dynamo, name, max(int(getattr(dynamo, name)), 4 * FLEX_RECOMPILE_LIMIT))
            break
    for name in ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit"):
        if hasattr(dynamo, name):
            setattr(dynamo, name, True)
            break


def pretrained_weights(mc: ModelConfig, model_dir: str | Path) -> dict[str, torch.Tensor]:
    """A model directory's weights (its `*.safetensors`, transformers names) in the one-rank layout of
    `mc.backend`: what `load_params` and `Core.load_whole_weights` take (a tied lm_head left out: the
    embeddings cover it; Megatron-core's fused layout for that backend)."""
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    if mc.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if mc.backend == "megatron":
        from gyre_train.megatron import hf_to_megatron

        return hf_to_megatron(state, mc)
    return state


def load_pretrained(model: torch.nn.Module, mc: ModelConfig, model_dir: str | Path) -> None:
    """Copy a model directory's weights into `model` (built from `mc`, one rank); every parameter must be
    covered and no tensor left over."""
    state = pretrained_weights(mc, model_dir)
    names = {n for n, _ in model.named_parameters()}
    if set(state) != names:
        raise ValueError(
            f"{model_dir} does not fit the model built from its config: missing {sorted(names - set(state))[:5]}, "
            f"extra {sorted(set(state) - names)[:5]}"
        )
    load_params(model, state)


@dataclass(frozen=True)
class Layout:
    """Parameter order, shapes and offsets into the flat gradient vector."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    numel: int
    digest: str

    @staticmethod
    def of(model: torch.nn.Module) -> Layout:
        names, shapes, offsets = [], [], []
        n = 0
        for name, p in model.named_parameters():
            names.append(name)
            shapes.append(tuple(p.shape))
            offsets.append(n)
            n += p.numel()
        digest = layout_digest((k, p.shape, p.dtype) for k, p in model.named_parameters())
        return Layout(tuple(names), tuple(shapes), tuple(offsets), n, digest)


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameter data tensors by name (what snapshots are published from and pulled into)."""
    return {n: p.data for n, p in model.named_parameters()}


def micro_gradient(
    model: torch.nn.Module,
    layout: Layout,
    batch: PackedBatch,
    loss_cfg: LossConfig,
    attention: Attention = "dense",
    out: torch.Tensor | None = None,
    chunk_budget: int = 0,
    chunk_memory: ChunkMemory = CHUNK_MEMORY,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Flat gradient of one micro-batch's weighted policy loss (written into `out` if given: a float32 or
    bfloat16 vector of `layout.numel` on any device, e.g. pinned host memory; a new float32 one if not),
    and its metrics. With
    `chunk_budget`, a micro-batch larger than it is trained in chunks (`gyre_train.chunked`: shared
    prefix forwarded once, activation memory of one chunk), keeping what the chunks share as
    `chunk_memory` says (`gyre_train.defaults.CHUNK_MEMORY`); transformers backend only. On a
    FlexAttention model a micro-batch computes with tree attention where `chunk_attention` says so
    (whole or in chunks), with FlexAttention beyond."""
    t0 = time.perf_counter()
    device = next(model.parameters()).device
    model.zero_grad(set_to_none=True)
    megatron = type(model).__module__.startswith("megatron.")  # a Megatron-core GPTModel
    with attention_kernels(device):
        metrics = _loss_backward(
            model, batch, loss_cfg, attention, chunk_budget, chunk_memory, megatron, device
        )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    flat = out if out is not None else torch.empty(layout.numel, dtype=torch.float32)
    if flat.shape != (layout.numel,) or flat.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(
            f"out must be float32 or bfloat16 of shape ({layout.numel},), got {flat.dtype} {tuple(flat.shape)}"
        )
    ps = dict(model.named_parameters())
    t1 = time.perf_counter()
    for name, off, shape in zip(layout.names, layout.offsets, layout.shapes, strict=True):
        g = ps[name].grad
        k = int(np.prod(shape, dtype=np.int64))
        if g is None:
            flat[off : off + k].zero_()
        else:  # async into pinned memory; bf16 -> f32 is exact, f32 -> bf16 rounds to nearest even
            flat[off : off + k].copy_(g.detach().reshape(-1), non_blocking=True)
    if device.type == "cuda" or flat.device.type == "cuda":
        torch.cuda.synchronize(device if device.type == "cuda" else flat.device)
    model.zero_grad(set_to_none=True)
    metrics["compute_s"] = t1 - t0
    metrics["copy_s"] = time.perf_counter() - t1
    return flat, metrics


@torch.no_grad()
def target_logprobs_of(
    model: torch.nn.Module, batch: PackedBatch, attention: Attention = "dense"
) -> torch.Tensor:
    """Logprobs [L] of a packed micro-batch's loss targets at temperature 1: the forward `micro_gradient`
    trains with (same attention kernels), without the gradient."""
    device = next(model.parameters()).device
    tb = TorchBatch.from_packed(batch, device=device)
    with attention_kernels(device):
        if type(model).__module__.startswith("megatron."):
            from gyre_train.megatron import tree_target_logprobs

            return tree_target_logprobs(model, tb)
        kernel = chunk_attention(attention, batch.num_tokens, batch.num_tokens)
        if kernel == "tree":  # as micro_gradient computes it on a FlexAttention model
            from gyre_train.chunked import tree_target_logprobs as whole_tree

            with attention_implementation(model, kernel):
                return whole_tree(model, batch, kernel)
        return target_logprobs_entropy(model, tb, attention=attention)[0]


def chunk_attention(attention: Attention, chunk_budget: int, num_tokens: int) -> Kernel:
    """The attention a micro-batch of `num_tokens` trained in chunks of `chunk_budget` (a whole one: one
    chunk of `num_tokens`) is computed with on a model built for `attention`: on a FlexAttention model,
    tree attention (flash attention over the tree's runs, nothing compiled) up to
    `defaults.TREE_CHUNK_ELEMENTS` (chunk budget x tokens), else FlexAttention; a dense model's own."""
    return "tree" if attention == "flex" and chunk_budget * num_tokens <= TREE_CHUNK_ELEMENTS else attention


@contextlib.contextmanager
def attention_implementation(model: torch.nn.Module, attention: Kernel) -> Any:
    """`model` (a transformers model) computing with `attention` inside the block, and with the
    implementation it had before after it."""
    cfg = getattr(model, "config", None)
    was = getattr(cfg, "_attn_implementation", None)
    want = HF_ATTENTION[attention]
    if attention == "tree":
        from gyre_train import treeattn

        treeattn.register()
    if cfg is None or was is None or was == want:
        yield
        return
    model.set_attn_implementation(want)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_attn_implementation(was)  # type: ignore[operator]


def attention_kernels(device: torch.device) -> Any:
    """On a GPU, keep SDPA (dense ancestor masks; tree attention's runs, which go to flash attention) off
    cuDNN's kernel, which builds a plan for every new sequence length (seconds on a 1.5B model at a
    satellite's first micro-batch of a new length); the memory-efficient kernel takes the same masks with
    no per-shape set-up. The same choice everywhere
    micro_gradient runs, so every replica computes a micro-batch with the same kernels."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _loss_backward(
    model: torch.nn.Module,
    batch: PackedBatch,
    loss_cfg: LossConfig,
    attention: Attention,
    chunk_budget: int,
    chunk_memory: ChunkMemory,
    megatron: bool,
    device: torch.device,
) -> dict[str, float]:
    chunked = bool(chunk_budget) and batch.num_tokens > chunk_budget and not megatron
    kernel = chunk_attention(attention, chunk_budget if chunked else batch.num_tokens, batch.num_tokens)
    if chunked or (kernel == "tree" and not megatron):  # a whole micro-batch: one chunk of its own size
        from gyre_train.chunked import chunked_loss_backward
        from gyre_train.layered import choose, layered_loss_backward

        budget = chunk_budget if chunked else batch.num_tokens
        how = choose(batch, budget, model, chunk_memory) if chunked else "kept"
        with attention_implementation(model, kernel):
            if how == "kept":
                return chunked_loss_backward(model, batch, budget, loss_cfg, kernel)
            return layered_loss_backward(model, batch, budget, loss_cfg, kernel, host=how == "layers-host")
    tb = TorchBatch.from_packed(batch, device=device)
    if megatron:  # this rank's part: its tensor-parallel shards, its pipeline stage
        from gyre_train.megatron import pipeline_loss_backward

        return pipeline_loss_backward(model, tb, loss_cfg)
    lp, entropy = target_logprobs_entropy(model, tb, attention=attention, temperature=loss_cfg.temperature)
    loss, metrics = policy_loss(lp, tb, loss_cfg, entropy)
    loss.backward()
    return metrics


def set_gradients(model: torch.nn.Module, layout: Layout, flat: torch.Tensor) -> None:
    ps = dict(model.named_parameters())
    for name, off, shape in zip(layout.names, layout.offsets, layout.shapes, strict=True):
        p = ps[name]
        k = int(np.prod(shape, dtype=np.int64))
        p.grad = flat[off : off + k].reshape(shape).to(device=p.device, dtype=p.dtype, copy=True)


def load_params(model: torch.nn.Module, tensors: Mapping[str, Any]) -> None:
    ps = dict(model.named_parameters())
    if set(ps) != set(tensors):
        raise ValueError(f"parameter names differ: {sorted(set(ps) ^ set(tensors))[:5]}")
    with torch.no_grad():
        for name, p in ps.items():
            p.copy_(torch.as_tensor(tensors[name]).reshape(p.shape))
