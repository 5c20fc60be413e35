"""The embedded default's tokenizer recipe, with no torch: a byte-level BPE trained locally with
`tokenizers` on standard-library sources plus chat markup, ChatML and tool/thinking tokens first so their
ids are stable. `gyre-engine create-model` wraps it for transformers; the proxy's benchmark uses it bare.
Needs the `tokenizers` package (in the `server` extra; the proxy depends on it directly)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

_CORPUS_MODULES = [
    "json",
    "argparse",
    "textwrap",
    "dataclasses",
    "unittest",
    "asyncio.tasks",
    "csv",
    "email.message",
]


def corpus() -> list[str]:
    """Training text for the tokenizer: sources of a few standard-library modules, plus chat markup."""
    texts = []
    for name in _CORPUS_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            texts.append(Path(spec.origin).read_text(encoding="utf-8"))
    texts.append('<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>\n' * 4)
    return texts


def train_bpe(vocab_size: int = 2048) -> Any:
    """A `tokenizers.Tokenizer` (byte-level BPE) trained on `corpus()`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS + ADDED_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok
