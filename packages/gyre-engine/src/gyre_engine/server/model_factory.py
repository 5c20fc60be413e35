"""Creates the embedded default model locally, with no download: a causal LM with random weights (a
Qwen3 by default; also the dense Qwen2 and Llama architectures, with any of their config fields set)
and a byte-level BPE tokenizer trained here with `tokenizers` on text that ships with Python itself,
saved as a normal transformers model directory (config, safetensors, tokenizer, chat template with
tools as Qwen-style `<tool_call>` JSON and `<think>` blocks, generation config).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    PreTrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from gyre_engine.tokenizer import train_bpe

# Qwen-style: system prompt with tools in <tools></tools>, tool calls as JSON inside <tool_call>, tool
# results as user turns wrapped in <tool_response>, assistant reasoning in <think> blocks (kept only
# after the last user turn), and `enable_thinking=false` opening an empty think block.
CHAT_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}{{ "\n" }}{{ tool | tojson }}{% endfor %}{{ "\n" }}</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{%- for m in messages %}
{%- if m.role == 'user' %}<|im_start|>user
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{% if m.reasoning_content and loop.index0 > ns.last_user %}<think>
{{ m.reasoning_content }}
</think>

{% endif %}{{ m.content or '' }}
{%- for tc in m.tool_calls or [] %}{% set f = tc.function if tc.function else tc %}
<tool_call>
{"name": "{{ f.name }}", "arguments": {{ f.arguments if f.arguments is string else f.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' %}{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{{ "\n" }}{% endif %}<tool_response>
{{ m.content }}
</tool_response>{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>{{ "\n" }}{% else %}{{ "\n" }}{% endif %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""


FAMILIES: dict[str, type[PreTrainedConfig]] = {
    "qwen3": Qwen3Config,
    "qwen2": Qwen2Config,
    "llama": LlamaConfig,
}
"""The architectures `create_model` writes (by `model_type`); Qwen2.5 checkpoints are `qwen2`."""


@dataclass(frozen=True)
class ModelShape:
    """Dimensions (Qwen3 names, the same in every family); `tiny` is the embedded default (random outputs for plumbing tests), `mini` the
    one `gyre demo` warm-starts (1M parameters), `qwen3_0_6b` the benchmark's larger shape."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int | None = None  # None: the tokenizer's size
    max_position_embeddings: int = 40960
    initializer_range: float = 0.02


SHAPES = {
    "tiny": ModelShape(64, 2, 4, 2, 16, 128, initializer_range=0.5),
    "mini": ModelShape(128, 4, 4, 2, 32, 384),
    "small": ModelShape(256, 4, 8, 4, 32, 768),
    "qwen3-0.6b": ModelShape(1024, 28, 16, 8, 128, 3072, vocab_size=151936),
}


def shape_config(
    shape: str,
    vocab_size: int,
    *,
    eos_token_id: int,
    pad_token_id: int,
    bos_token_id: int | None = None,
    family: str = "qwen3",
    overrides: Mapping[str, Any] | None = None,
) -> PreTrainedConfig:
    """The config of a named shape in `family` (tied embeddings), with the given vocabulary and special
    ids; `overrides` sets any other field of the family's config (or replaces one of these), as
    `config.json` would (e.g. `rope_theta`, `rope_scaling`, `rms_norm_eps`, `tie_word_embeddings`)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {sorted(FAMILIES)}")
    s = SHAPES[shape]
    fields: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_hidden_layers,
        num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_key_value_heads,
        head_dim=s.head_dim,
        max_position_embeddings=s.max_position_embeddings,
        tie_word_embeddings=True,
        initializer_range=s.initializer_range,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
    fields.update(overrides or {})
    return FAMILIES[family].from_dict(fields)


def train_tokenizer(vocab_size: int = 2048) -> PreTrainedTokenizerFast:
    """The embedded default's tokenizer (`gyre_engine.tokenizer`) wrapped for transformers, with the chat
    template."""
    tok = train_bpe(vocab_size)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 40960
    return fast


def create_model(
    out_dir: str | Path,
    shape: str = "tiny",
    seed: int = 0,
    dtype: str = "float32",
    family: str = "qwen3",
    overrides: Mapping[str, Any] | None = None,
) -> Path:
    """Write a ready-to-serve model directory of `family` (qwen3, qwen2 or llama) with `shape`'s
    dimensions and `overrides`' config fields (`shape_config`); returns its path."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {sorted(SHAPES)}")
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {sorted(FAMILIES)}")
    s = SHAPES[shape]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    eos = [int(tokenizer.convert_tokens_to_ids(t)) for t in ("<|im_end|>", "<|endoftext|>")]  # type: ignore[arg-type]
    config = shape_config(
        shape,
        vocab_size=s.vocab_size or len(tokenizer),
        bos_token_id=None,
        eos_token_id=eos[0],
        pad_token_id=eos[1],
        family=family,
        overrides=overrides,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=eos[1], do_sample=False)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
