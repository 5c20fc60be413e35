"""Anthropic Messages API replies: the message object and the SSE event sequence of one call.

Streaming follows the API's event order: message_start, ping, content_block_start/delta/stop per block
(text_delta, thinking_delta + signature_delta, input_json_delta), message_delta (stop_reason, usage),
message_stop. An output with no blocks (the model ended its turn at once) is `content: []`, as the API
answers it. Requests are read in `anthropic_request`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from gyre_proxy.core import CallRun
from gyre_proxy.toolparse import Block, BlockKind

_enc = msgspec.json.Encoder()


def error_body(kind: str, message: str) -> bytes:
    return _enc.encode({"type": "error", "error": {"type": kind, "message": message}})


def _block_json(run: CallRun, b: Block, index: int) -> dict[str, Any]:
    if b.kind is BlockKind.THINKING:
        return {"type": "thinking", "thinking": b.text, "signature": run.signature}
    if b.kind is BlockKind.TEXT:
        return {"type": "text", "text": b.text}
    return {"type": "tool_use", "id": run.tool_id(index), "name": b.name, "input": json.loads(b.text)}


def _usage(run: CallRun) -> dict[str, int]:
    cached = min(run.result.cached_tokens, run.n_input)
    return {
        "input_tokens": run.n_input - cached,
        "output_tokens": len(run.result.output_ids),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def message_json(run: CallRun, model: str) -> bytes:
    return _enc.encode(
        {
            "id": f"msg_{run.call_id}",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [_block_json(run, b, i) for i, b in enumerate(run.final_blocks)],
            "stop_reason": run.stop_reason,
            "stop_sequence": run.result.matched if run.stop_reason == "stop_sequence" else None,
            "usage": _usage(run),
        }
    )


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + _enc.encode(data) + b"\n\n"


async def stream_events(run: CallRun, model: str) -> AsyncIterator[bytes]:
    """The full SSE sequence for one call; the record is on disk before message_delta is sent."""
    yield _sse(
        "message_start",
        {
            "type": "message_start",
            "message": {
                "id": f"msg_{run.call_id}",
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": run.n_input, "output_tokens": 0},
            },
        },
    )
    yield _sse("ping", {"type": "ping"})
    sent: list[str] = []  # text sent so far per block index
    open_ix = -1

    def delta(ix: int, b: Block, grow: str) -> bytes:
        d = (
            {"type": "thinking_delta", "thinking": grow}
            if b.kind is BlockKind.THINKING
            else {"type": "text_delta", "text": grow}
        )
        return _sse("content_block_delta", {"type": "content_block_delta", "index": ix, "delta": d})

    def close(ix: int, b: Block | None) -> list[bytes]:
        out = []
        if b is not None and b.kind is BlockKind.THINKING:
            sig = {"type": "signature_delta", "signature": run.signature}
            out.append(
                _sse("content_block_delta", {"type": "content_block_delta", "index": ix, "delta": sig})
            )
        out.append(_sse("content_block_stop", {"type": "content_block_stop", "index": ix}))
        return out

    def emit(blocks: list[Block]) -> list[bytes]:
        nonlocal open_ix
        out: list[bytes] = []
        for ix, b in enumerate(blocks):
            if ix < len(sent):
                if ix == open_ix and b.text.startswith(sent[ix]) and len(b.text) > len(sent[ix]):
                    out.append(delta(ix, b, b.text[len(sent[ix]) :]))
                    sent[ix] = b.text
                continue
            if open_ix >= 0:
                out += close(open_ix, blocks[open_ix])
                open_ix = -1
            if b.kind is BlockKind.TOOL:
                start = {"type": "tool_use", "id": run.tool_id(ix), "name": b.name, "input": {}}
                out.append(
                    _sse(
                        "content_block_start",
                        {"type": "content_block_start", "index": ix, "content_block": start},
                    )
                )
                d = {"type": "input_json_delta", "partial_json": b.text}
                out.append(
                    _sse("content_block_delta", {"type": "content_block_delta", "index": ix, "delta": d})
                )
                out += close(ix, b)
                sent.append(b.text)
                continue
            start = (
                {"type": "thinking", "thinking": "", "signature": ""}
                if b.kind is BlockKind.THINKING
                else {"type": "text", "text": ""}
            )
            out.append(
                _sse(
                    "content_block_start",
                    {"type": "content_block_start", "index": ix, "content_block": start},
                )
            )
            if b.text:
                out.append(delta(ix, b, b.text))
            sent.append(b.text)
            open_ix = ix
        return out

    async for blocks in run.blocks():
        for ev in emit(blocks):
            yield ev
    for ev in emit(run.final_blocks):
        yield ev
    if open_ix >= 0:
        for ev in close(open_ix, run.final_blocks[open_ix] if open_ix < len(run.final_blocks) else None):
            yield ev
    await run.finish()
    yield _sse(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {
                "stop_reason": run.stop_reason,
                "stop_sequence": run.result.matched if run.stop_reason == "stop_sequence" else None,
            },
            "usage": {"output_tokens": len(run.result.output_ids)},
        },
    )
    yield _sse("message_stop", {"type": "message_stop"})
