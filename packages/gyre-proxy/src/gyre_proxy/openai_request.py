"""OpenAI Chat Completions requests: decoding, checks, and conversion into a `Conversation` and `Sampling`.

Every top-level field is either honoured, accepted and ignored (named in `IGNORED`: bookkeeping a local
policy has no use for), or refused with a 400 naming it: unknown fields, `n` > 1, a `response_format`
other than text, `parallel_tool_calls: false` and a `tool_choice` other than "auto" (neither can be
enforced without constrained decoding), `top_logprobs` without `logprobs`. Honoured beyond messages and
tools: `max_completion_tokens` / `max_tokens` (>= 1, as OpenAI requires), `temperature`, `top_p`, `stop`,
`seed` (SGLang `sampling_seed`), `presence_penalty`, `frequency_penalty`, `logit_bias`, `logprobs` and
`top_logprobs` (SGLang `top_logprobs_num`), `reasoning_effort` (thinking on or off), `stream_options`,
and the two sampling extensions SGLang's and vLLM's OpenAI servers take: `min_tokens` (SGLang
`min_new_tokens`) and `ignore_eos` (keep sampling past the end-of-turn token, up to the token budget).

Conversations are checked as OpenAI checks them: a `tool` message answers a tool call of the assistant
message before it (other tool messages in between), an assistant message's tool calls are all answered
by the tool messages right after it, content is present (an assistant message may leave it out only with
tool calls), content parts are of a type the role takes, and tool-call arguments are a JSON object (the
prompt embeds them as one).
"""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec

from gyre_proxy.chat import Conversation, Kind, RequestError, Sampling, ToolCall, Turn, json_error
from gyre_proxy.render import tool_json
from gyre_proxy.strip import Stripper

IGNORED = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "prompt_cache_retention")
PART_TYPES = {
    "user": ("text", "image_url", "input_audio", "file"),
    "assistant": ("text", "refusal"),
    "system": ("text",),
    "developer": ("text",),
    "tool": ("text",),
}


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


class ORequest(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    messages: list[OMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stream: bool = False
    stream_options: OStreamOptions | None = None
    tools: list[OTool] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    reasoning_effort: str | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    n: int | None = None
    response_format: dict[str, Any] | None = None
    # accepted and ignored (IGNORED)
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None


_dec = msgspec.json.Decoder(ORequest)
_UNKNOWN = "Object contains unknown field `"


def _field_of(exc: msgspec.ValidationError) -> str:
    msg = str(exc)
    at = msg.rfind("at `$")
    path = msg[at + 5 : msg.rfind("`")].lstrip(".") if at >= 0 else ""
    if msg.startswith(_UNKNOWN):  # msgspec names the unknown key only in its message
        name = msg[len(_UNKNOWN) : msg.index("`", len(_UNKNOWN))]
        return f"{path}.{name}" if path else name
    return path or "body"


def decode(body: bytes) -> ORequest:
    """The request, checked (RequestError naming the field otherwise)."""
    try:
        req = _dec.decode(body)
    except msgspec.ValidationError as exc:
        field = _field_of(exc)
        if str(exc).startswith(_UNKNOWN):
            raise RequestError(field, "unknown or unsupported field") from None
        raise RequestError(field, str(exc)) from None
    except msgspec.DecodeError as exc:
        raise json_error(exc, body) from None
    _check_fields(req)
    _check_messages(req.messages)
    return req


# ------------------------------------------------------------------------------------------- checks


def _refuse(field: str, why: str) -> None:
    raise RequestError(field, why)


def _check_fields(req: ORequest) -> None:
    if not req.messages:
        _refuse("messages", "at least one message is required")
    for name in ("max_completion_tokens", "max_tokens"):
        v = getattr(req, name)
        if v is not None and v < 1:
            _refuse(name, f"must be >= 1, got {v}")
    if req.min_tokens is not None:
        most = req.max_completion_tokens or req.max_tokens
        if req.min_tokens < 0 or (most is not None and req.min_tokens > most):
            _refuse("min_tokens", f"must be in [0, max_tokens], got {req.min_tokens}")
    if req.n not in (None, 1):
        _refuse("n", f"only n=1 is supported (one sample per call), got {req.n}")
    if req.response_format is not None and req.response_format.get("type") != "text":
        _refuse("response_format", "only {'type': 'text'} is supported (no constrained decoding)")
    if req.parallel_tool_calls is False:
        _refuse("parallel_tool_calls", "false cannot be enforced (no constrained decoding)")
    if req.tool_choice not in (None, "auto"):
        _refuse("tool_choice", 'only "auto" is supported (no constrained decoding)')
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(req, name)
        if v is not None and not -2.0 <= v <= 2.0:
            _refuse(name, f"must be in [-2, 2], got {v}")
    if req.top_logprobs is not None:
        if not 0 <= req.top_logprobs <= 20:
            _refuse("top_logprobs", f"must be in [0, 20], got {req.top_logprobs}")
        if req.top_logprobs and not req.logprobs:
            _refuse("top_logprobs", "needs logprobs: true")
    for key, bias in (req.logit_bias or {}).items():
        if not key.isdigit():
            _refuse(f"logit_bias.{key}", "keys are token ids")
        if not (-100.0 <= bias <= 100.0 and math.isfinite(bias)):
            _refuse(f"logit_bias.{key}", f"bias must be in [-100, 100], got {bias}")


def _check_messages(messages: list[OMessage]) -> None:
    asked: set[str] = set()  # tool calls of the last assistant message, not answered yet
    asked_at = -1
    for i, m in enumerate(messages):
        if m.role not in PART_TYPES:
            _refuse(f"messages.{i}.role", f"unknown role {m.role!r}")
        if m.role != "tool" and asked:
            _refuse(
                f"messages.{asked_at}",
                "an assistant message with 'tool_calls' must be followed by tool messages responding to "
                f"each 'tool_call_id'; these had none: {', '.join(sorted(asked))}",
            )
        _check_content(m, i)
        if m.role == "tool":
            if not m.tool_call_id:
                _refuse(f"messages.{i}.tool_call_id", "a tool message needs tool_call_id")
            if asked_at < 0 or not _called(messages[asked_at], m):
                _refuse(
                    f"messages.{i}",
                    "a message with role 'tool' must answer a tool call of the preceding assistant "
                    f"message (no tool call has id {m.tool_call_id!r})",
                )
            asked.discard(m.tool_call_id or "")
        elif m.role == "assistant" and m.tool_calls:
            _check_calls(m.tool_calls, i)
            asked, asked_at = {c.id for c in m.tool_calls}, i
        else:
            asked_at = -1


def _called(assistant: OMessage, tool: OMessage) -> bool:
    return any(c.id == tool.tool_call_id for c in assistant.tool_calls or [])


def _check_content(m: OMessage, i: int) -> None:
    if m.content is None:
        if m.role != "assistant" or not m.tool_calls:
            _refuse(f"messages.{i}.content", "expected a string or an array of content parts, got null")
        return
    if isinstance(m.content, list):
        for j, p in enumerate(m.content):
            if p.type not in PART_TYPES[m.role]:
                allowed = ", ".join(PART_TYPES[m.role])
                _refuse(f"messages.{i}.content.{j}.type", f"{p.type!r} is not one of {allowed}")


def _check_calls(calls: list[OToolCall], i: int) -> None:
    for j, c in enumerate(calls):
        if c.type != "function":
            _refuse(f"messages.{i}.tool_calls.{j}.type", f"expected 'function', got {c.type!r}")
        if not _arguments_ok(c):
            _refuse(
                f"messages.{i}.tool_calls.{j}.function.arguments",
                f"must be a JSON object, got {c.function.arguments[:80]!r}",
            )


def _arguments_ok(c: OToolCall) -> bool:
    if not c.function.arguments:
        return True  # no arguments: rendered as {}
    try:
        return isinstance(json.loads(c.function.arguments), dict)
    except ValueError:
        return False


# -------------------------------------------------------------------------------------- conversion


def _text(c: str | list[OPart] | None) -> str:
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    return "\n".join(p.text or "" for p in c if p.type == "text")


def to_conversation(req: ORequest, stripper: Stripper, default_thinking: bool = False) -> Conversation:
    system = ""
    stripped: tuple[tuple[str, str], ...] = ()
    turns: list[Turn] = []
    for i, m in enumerate(req.messages):
        if m.role in ("system", "developer") and i == 0:
            blocks = [m.content] if isinstance(m.content, str) else [p.text or "" for p in m.content or []]
            kept, stripped = stripper.split(blocks)
            system = "\n".join(kept)
        elif m.role in ("system", "developer"):
            turns.append(Turn(Kind.SYSTEM, _text(m.content)))
        elif m.role == "user":
            turns.append(Turn(Kind.USER, _text(m.content)))
        elif m.role == "assistant":
            calls = tuple(
                ToolCall(c.id, c.function.name, c.function.arguments or "{}") for c in m.tool_calls or []
            )
            turns.append(Turn(Kind.ASSISTANT, _text(m.content), m.reasoning_content or "", "", calls))
        else:
            turns.append(Turn(Kind.TOOL, _text(m.content), tool_call_id=m.tool_call_id or ""))
    tools = tuple(tool_json({"type": "function", "function": t.function}) for t in req.tools or [])
    thinking = req.reasoning_effort not in (None, "none", "minimal") or default_thinking
    return Conversation(system, tools, tuple(turns), thinking, stripped)


def to_sampling(req: ORequest, default_max: int, vocab_size: int) -> Sampling:
    if req.max_completion_tokens is not None:
        mx = req.max_completion_tokens
    else:
        mx = req.max_tokens if req.max_tokens is not None else default_max
    bias = []
    for key, v in (req.logit_bias or {}).items():
        if int(key) >= vocab_size:
            raise RequestError(f"logit_bias.{key}", f"not a token id of this model (vocabulary {vocab_size})")
        bias.append((int(key), float(v)))
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return Sampling(
        mx,
        1.0 if req.temperature is None else req.temperature,
        1.0 if req.top_p is None else req.top_p,
        -1,
        stop,
        seed=req.seed,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias=tuple(bias),
        top_logprobs=(req.top_logprobs or 0) if req.logprobs else 0,
        min_new_tokens=req.min_tokens or 0,
        ignore_eos=bool(req.ignore_eos),
    )
