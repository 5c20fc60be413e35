"""Anthropic Messages API: request parsing into a `Conversation`, responses and the SSE event sequence.

Requests decode strictly where the policy depends on a field (roles, content blocks, max_tokens) and
leniently elsewhere: cache_control, context_management, metadata, output_config, container and other
fields a local policy cannot honour are accepted and ignored. Streaming follows the API's event order:
message_start, ping, content_block_start/delta/stop per block (text_delta, thinking_delta +
signature_delta, input_json_delta), message_delta (stop_reason, usage), message_stop.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from gyre_proxy.chat import Conversation, Kind, RequestError, Sampling, ToolCall, Turn
from gyre_proxy.core import CallRun
from gyre_proxy.render import tool_json
from gyre_proxy.toolparse import Block, BlockKind


class ABlock(msgspec.Struct, omit_defaults=True):
    """Any content block; which fields matter depends on `type`."""

    type: str
    text: str | None = None
    thinking: str | None = None
    signature: str | None = None
    id: str | None = None
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None
    content: str | list[ABlock] | None = None
    is_error: bool = False


class AMessage(msgspec.Struct):
    role: str
    content: str | list[ABlock]


class ATool(msgspec.Struct, omit_defaults=True):
    name: str
    description: str = ""
    input_schema: dict[str, Any] | None = None
    type: str | None = None


class AThinking(msgspec.Struct):
    type: str
    budget_tokens: int | None = None


class ARequest(msgspec.Struct):
    model: str
    messages: list[AMessage]
    max_tokens: int = 4096
    system: str | list[ABlock] | None = None
    stream: bool = False
    tools: list[ATool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: AThinking | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None


class ACountRequest(msgspec.Struct):
    messages: list[AMessage]
    model: str = ""
    system: str | list[ABlock] | None = None
    tools: list[ATool] | None = None
    thinking: AThinking | None = None


_req_dec = msgspec.json.Decoder(ARequest)
_count_dec = msgspec.json.Decoder(ACountRequest)
_enc = msgspec.json.Encoder()


def _field_of(exc: msgspec.ValidationError) -> str:
    msg = str(exc)
    at = msg.rfind("at `$")
    return msg[at + 5 : msg.rfind("`")].lstrip(".") if at >= 0 else "body"


def decode(body: bytes, count: bool = False) -> ARequest | ACountRequest:
    try:
        return (_count_dec if count else _req_dec).decode(body)
    except msgspec.ValidationError as exc:
        raise RequestError(_field_of(exc), str(exc)) from None
    except msgspec.DecodeError as exc:
        raise RequestError("body", f"invalid JSON: {exc}") from None


def _text_of(content: str | list[ABlock] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for b in content:
        if b.type == "text":
            parts.append(b.text or "")
        elif b.type in ("image", "document"):
            parts.append(f"[{b.type} omitted]")
    return "\n".join(parts)


def _system(system: str | list[ABlock] | None) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    return "\n\n".join(b.text or "" for b in system if b.type == "text")


def _tools(tools: list[ATool] | None) -> tuple[str, ...]:
    out = []
    for t in tools or []:
        fn: dict[str, Any] = {"name": t.name, "description": t.description}
        fn["parameters"] = (
            t.input_schema if t.input_schema is not None else {"type": "object", "properties": {}}
        )
        out.append(tool_json({"type": "function", "function": fn}))
    return tuple(out)


def _turns(messages: list[AMessage]) -> tuple[Turn, ...]:
    turns: list[Turn] = []
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if m.role not in ("user", "assistant", "system"):
            raise RequestError(
                f"{where}.role", f"unknown role {m.role!r} (expected user, assistant or system)"
            )
        if m.role == "system":
            turns.append(Turn(Kind.SYSTEM, _text_of(m.content)))
            continue
        if isinstance(m.content, str):
            turns.append(Turn(Kind.USER if m.role == "user" else Kind.ASSISTANT, m.content))
            continue
        if m.role == "user":
            texts: list[str] = []
            for j, b in enumerate(m.content):
                if b.type == "tool_result":
                    if texts:
                        turns.append(Turn(Kind.USER, "\n\n".join(texts)))
                        texts = []
                    if not b.tool_use_id:
                        raise RequestError(
                            f"{where}.content.{j}.tool_use_id", "a tool_result needs tool_use_id"
                        )
                    turns.append(
                        Turn(Kind.TOOL, _text_of(b.content), tool_call_id=b.tool_use_id, is_error=b.is_error)
                    )
                elif b.type == "text":
                    texts.append(b.text or "")
                elif b.type in ("image", "document"):
                    texts.append(f"[{b.type} omitted]")
            if texts:
                turns.append(Turn(Kind.USER, "\n\n".join(texts)))
            continue
        reasoning, signature, text = [], "", []
        calls: list[ToolCall] = []
        for j, b in enumerate(m.content):
            if b.type == "thinking":
                reasoning.append(b.thinking or "")
                signature = signature or (b.signature or "")
            elif b.type == "text":
                text.append(b.text or "")
            elif b.type == "tool_use":
                if not b.id or not b.name:
                    raise RequestError(f"{where}.content.{j}", "a tool_use block needs id and name")
                calls.append(ToolCall(b.id, b.name, json.dumps(b.input or {}, ensure_ascii=False)))
        turns.append(Turn(Kind.ASSISTANT, "".join(text), "\n".join(reasoning), signature, tuple(calls)))
    return tuple(turns)


def _thinking_on(t: AThinking | None) -> bool:
    return t is not None and t.type in ("enabled", "adaptive")


def to_conversation(req: ARequest | ACountRequest) -> Conversation:
    if not req.messages and isinstance(req, ARequest):
        raise RequestError("messages", "at least one message is required")
    return Conversation(
        _system(req.system), _tools(req.tools), _turns(req.messages), _thinking_on(req.thinking)
    )


def to_sampling(req: ARequest) -> Sampling:
    if req.max_tokens < 1:
        raise RequestError("max_tokens", f"must be >= 1, got {req.max_tokens}")
    return Sampling(
        req.max_tokens,
        1.0 if req.temperature is None else req.temperature,
        1.0 if req.top_p is None else req.top_p,
        -1 if req.top_k is None else req.top_k,
        tuple(req.stop_sequences or ()),
    )


# ---------------------------------------------------------------------------------------------- replies


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
