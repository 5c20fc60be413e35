"""Splits the model's output text into thinking, text and tool-call blocks (Qwen style).

`<think>...</think>` becomes a thinking block; each `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
with valid JSON becomes a tool call; a malformed or unterminated one stays verbatim in the text around it
(one text block, exactly as the model wrote it), never an error. With
`final=False` (streaming) anything that might still grow into a tag or an unfinished tool call is held
back, so the blocks returned only ever grow: earlier blocks never change kind or shrink.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
END_TOKENS = ("<|im_end|>", "<|endoftext|>")


class BlockKind(enum.StrEnum):
    THINKING = "thinking"
    TEXT = "text"
    TOOL = "tool"


@dataclass(frozen=True)
class Block:
    kind: BlockKind
    text: str = ""  # thinking or text; for tools the raw JSON arguments
    name: str = ""  # tool name


def _partial_tag_len(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), 0, -1):
            if text.endswith(tag[:k]):
                best = max(best, k)
                break
    return best


def _tool(body: str) -> Block | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return Block(BlockKind.TOOL, json.dumps(args, ensure_ascii=False), obj["name"])


def strip_end(text: str) -> str:
    for tok in END_TOKENS:
        at = text.find(tok)
        if at >= 0:
            text = text[:at]
    return text


def parse(text: str, final: bool = True, thinking_open: bool = False) -> list[Block]:
    """Blocks of `text`. `thinking_open`: the prompt already opened a think block (reasoning first)."""
    text = strip_end(text)
    blocks: list[Block] = []
    pos = 0
    head = text.lstrip()
    if not final and len(head) < len(THINK_OPEN) and THINK_OPEN.startswith(head):
        return blocks  # may still become a think block
    if thinking_open or text.lstrip().startswith(THINK_OPEN):
        start = text.find(THINK_OPEN) + len(THINK_OPEN) if not thinking_open else 0
        end = text.find(THINK_CLOSE, start)
        if end < 0:
            body = text[start:]
            if not final:
                body = body[: len(body) - _partial_tag_len(body, (THINK_CLOSE,))]
            if body.strip():
                blocks.append(Block(BlockKind.THINKING, body.strip("\n")))
            return blocks
        body = text[start:end].strip("\n")
        if body.strip():
            blocks.append(Block(BlockKind.THINKING, body))
        pos = end + len(THINK_CLOSE)
        while pos < len(text) and text[pos] == "\n":
            pos += 1
    run = pos  # start of the current text run: text, and any malformed or cut tool calls in it
    while True:
        at = text.find(CALL_OPEN, pos)
        if at < 0:
            rest = text[run:]
            if not final:
                rest = rest[: len(rest) - _partial_tag_len(rest, (CALL_OPEN,))]
            _add_text(blocks, rest.rstrip("\n"))
            break
        close = text.find(CALL_CLOSE, at)
        if close < 0:
            # unterminated: while streaming it may still become a tool call; at the end it is text
            _add_text(blocks, text[run:] if final else text[run:at].rstrip("\n"))
            break
        tool = _tool(text[at + len(CALL_OPEN) : close].strip())
        pos = close + len(CALL_CLOSE)
        if tool is None:  # malformed: stays in the text run, verbatim
            continue
        _add_text(blocks, text[run:at].rstrip("\n"))
        blocks.append(tool)
        run = pos
    return blocks


def _add_text(blocks: list[Block], text: str) -> None:
    if text.strip():
        blocks.append(Block(BlockKind.TEXT, text))
