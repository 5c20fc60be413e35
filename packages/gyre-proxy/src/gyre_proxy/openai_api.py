"""OpenAI Chat Completions replies: the completion object and the chunk stream of one call.

`content` is the output's text blocks joined exactly as the proxy stores them for lookup (nothing added
between them), so the turn the client sends back is found again; an output with no text is `""` (null
only beside tool calls); thinking is `reasoning_content`. Streaming sends `chat.completion.chunk` objects
(role, content / reasoning_content deltas, one tool_calls delta per completed call, the finish reason with
the logprobs when asked, usage when asked) and ends with `data: [DONE]`. Requests are read in
`openai_request`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from gyre_proxy.core import CallRun
from gyre_proxy.logprobs import content_logprobs
from gyre_proxy.toolparse import Block, BlockKind

_enc = msgspec.json.Encoder()


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


def _logprobs(run: CallRun, wanted: bool) -> dict[str, Any] | None:
    if not wanted:
        return None
    r = run.result
    tok = run.proxy.tokenizer
    return {"content": content_logprobs(tok, r.output_ids, r.logprobs, r.top_logprobs), "refusal": None}


def completion_json(run: CallRun, model: str, logprobs: bool = False) -> bytes:
    blocks = run.final_blocks
    calls = [_tool_call(run, i, b) for i, b in enumerate(blocks) if b.kind is BlockKind.TOOL]
    text = "".join(b.text for b in blocks if b.kind is BlockKind.TEXT)
    reasoning = "\n".join(b.text for b in blocks if b.kind is BlockKind.THINKING)
    msg: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if reasoning:
        msg["reasoning_content"] = reasoning
    if calls:
        msg["tool_calls"] = calls
    choice = {"index": 0, "message": msg, "finish_reason": _finish(run), "logprobs": _logprobs(run, logprobs)}
    return _enc.encode(
        {
            "id": f"chatcmpl-{run.call_id}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
            "usage": _usage(run),
        }
    )


async def stream_chunks(
    run: CallRun, model: str, include_usage: bool, logprobs: bool = False
) -> AsyncIterator[bytes]:
    created = int(time.time())
    cid = f"chatcmpl-{run.call_id}"

    def chunk(
        delta: dict[str, Any],
        finish: str | None = None,
        usage: dict[str, Any] | None = None,
        lps: dict[str, Any] | None = None,
    ) -> bytes:
        obj: dict[str, Any] = {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lps}]
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
    yield chunk({}, _finish(run), lps=_logprobs(run, logprobs))
    if include_usage:
        yield chunk({}, usage=_usage(run))
    yield b"data: [DONE]\n\n"
