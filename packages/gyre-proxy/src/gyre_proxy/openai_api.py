"""OpenAI Chat Completions: request parsing into a `Conversation`, the response and the chunk stream.

The first system (or developer) message is the system prompt, later ones stay in place as system turns;
assistant `tool_calls` and `tool` messages map to tool turns; `reasoning_content` is the model's thinking.
Streaming sends `chat.completion.chunk` objects (role, content / reasoning_content deltas, one tool_calls
delta per completed call, the finish reason, usage when asked) and ends with `data: [DONE]`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from gyre_proxy.chat import Conversation, Kind, RequestError, Sampling, ToolCall, Turn
from gyre_proxy.core import CallRun
from gyre_proxy.render import tool_json
from gyre_proxy.toolparse import Block, BlockKind


class OFunction(msgspec.Struct):
    name: str
    arguments: str = "{}"


class OToolCall(msgspec.Struct):
    id: str
    function: OFunction
    type: str = "function"


class OPart(msgspec.Struct):
    type: str
    text: str | None = None


class OMessage(msgspec.Struct):
    role: str
    content: str | list[OPart] | None = None
    tool_calls: list[OToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    name: str | None = None


class OTool(msgspec.Struct):
    function: dict[str, Any]
    type: str = "function"


class OStreamOptions(msgspec.Struct):
    include_usage: bool = False


class ORequest(msgspec.Struct):
    model: str
    messages: list[OMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stream: bool = False
    stream_options: OStreamOptions | None = None
    tools: list[OTool] | None = None
    tool_choice: Any = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    reasoning_effort: str | None = None


_dec = msgspec.json.Decoder(ORequest)
_enc = msgspec.json.Encoder()


def decode(body: bytes) -> ORequest:
    try:
        return _dec.decode(body)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        at = msg.rfind("at `$")
        field = msg[at + 5 : msg.rfind("`")].lstrip(".") if at >= 0 else "body"
        raise RequestError(field, msg) from None
    except msgspec.DecodeError as exc:
        raise RequestError("body", f"invalid JSON: {exc}") from None


def _text(c: str | list[OPart] | None) -> str:
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    return "\n".join(p.text or "" for p in c if p.type == "text")


def to_conversation(req: ORequest, default_thinking: bool = False) -> Conversation:
    if not req.messages:
        raise RequestError("messages", "at least one message is required")
    system = ""
    turns: list[Turn] = []
    for i, m in enumerate(req.messages):
        if m.role in ("system", "developer"):
            if i == 0:
                system = _text(m.content)
            else:
                turns.append(Turn(Kind.SYSTEM, _text(m.content)))
        elif m.role == "user":
            turns.append(Turn(Kind.USER, _text(m.content)))
        elif m.role == "assistant":
            calls = tuple(
                ToolCall(c.id, c.function.name, c.function.arguments or "{}") for c in m.tool_calls or []
            )
            turns.append(Turn(Kind.ASSISTANT, _text(m.content), m.reasoning_content or "", "", calls))
        elif m.role == "tool":
            if not m.tool_call_id:
                raise RequestError(f"messages.{i}.tool_call_id", "a tool message needs tool_call_id")
            turns.append(Turn(Kind.TOOL, _text(m.content), tool_call_id=m.tool_call_id))
        else:
            raise RequestError(f"messages.{i}.role", f"unknown role {m.role!r}")
    tools = tuple(tool_json({"type": "function", "function": t.function}) for t in req.tools or [])
    thinking = req.reasoning_effort not in (None, "none", "minimal") or default_thinking
    return Conversation(system, tools, tuple(turns), thinking)


def to_sampling(req: ORequest, default_max: int) -> Sampling:
    mx = req.max_completion_tokens or req.max_tokens or default_max
    if mx < 1:
        raise RequestError("max_tokens", f"must be >= 1, got {mx}")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return Sampling(
        mx,
        1.0 if req.temperature is None else req.temperature,
        1.0 if req.top_p is None else req.top_p,
        -1,
        stop,
    )


def error_body(kind: str, message: str, param: str | None = None, code: str | None = None) -> bytes:
    return _enc.encode({"error": {"message": message, "type": kind, "param": param, "code": code}})


def _finish(run: CallRun) -> str:
    r = run.stop_reason
    return "tool_calls" if r == "tool_use" else ("length" if r == "max_tokens" else "stop")


def _tool_call(run: CallRun, ix: int, b: Block) -> dict[str, Any]:
    return {"id": run.tool_id(ix), "type": "function", "function": {"name": b.name, "arguments": b.text}}


def _usage(run: CallRun) -> dict[str, Any]:
    n_out = len(run.result.output_ids)
    return {
        "prompt_tokens": run.n_input,
        "completion_tokens": n_out,
        "total_tokens": run.n_input + n_out,
        "prompt_tokens_details": {"cached_tokens": min(run.result.cached_tokens, run.n_input)},
    }


def completion_json(run: CallRun, model: str) -> bytes:
    blocks = run.final_blocks
    text = "\n".join(b.text for b in blocks if b.kind is BlockKind.TEXT)
    reasoning = "\n".join(b.text for b in blocks if b.kind is BlockKind.THINKING)
    msg: dict[str, Any] = {"role": "assistant", "content": text or None}
    if reasoning:
        msg["reasoning_content"] = reasoning
    calls = [_tool_call(run, i, b) for i, b in enumerate(blocks) if b.kind is BlockKind.TOOL]
    if calls:
        msg["tool_calls"] = calls
    return _enc.encode(
        {
            "id": f"chatcmpl-{run.call_id}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": msg, "finish_reason": _finish(run), "logprobs": None}],
            "usage": _usage(run),
        }
    )


async def stream_chunks(run: CallRun, model: str, include_usage: bool) -> AsyncIterator[bytes]:
    created = int(time.time())
    cid = f"chatcmpl-{run.call_id}"

    def chunk(delta: dict[str, Any], finish: str | None = None, usage: dict[str, Any] | None = None) -> bytes:
        obj: dict[str, Any] = {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
            if usage is None
            else [],
        }
        if usage is not None:
            obj["usage"] = usage
        return b"data: " + _enc.encode(obj) + b"\n\n"

    yield chunk({"role": "assistant", "content": ""})
    sent: list[str] = []
    n_tools = 0

    def emit(blocks: list[Block]) -> list[bytes]:
        nonlocal n_tools
        out: list[bytes] = []
        for ix, b in enumerate(blocks):
            prev = sent[ix] if ix < len(sent) else None
            if b.kind is BlockKind.TOOL:
                if prev is None:
                    tc = {"index": n_tools, **_tool_call(run, ix, b)}
                    out.append(chunk({"tool_calls": [tc]}))
                    n_tools += 1
                    sent.append(b.text)
                continue
            key = "reasoning_content" if b.kind is BlockKind.THINKING else "content"
            done = prev or ""
            if prev is None:
                sent.append("")
                if ix > 0 and blocks[ix - 1].kind is BlockKind.TEXT and key == "content":
                    out.append(chunk({key: "\n"}))
            if b.text.startswith(done) and len(b.text) > len(done):
                out.append(chunk({key: b.text[len(done) :]}))
                sent[ix] = b.text
        return out

    async for blocks in run.blocks():
        for c in emit(blocks):
            yield c
    for c in emit(run.final_blocks):
        yield c
    await run.finish()
    yield chunk({}, _finish(run))
    if include_usage:
        yield chunk({}, usage=_usage(run))
    yield b"data: [DONE]\n\n"
