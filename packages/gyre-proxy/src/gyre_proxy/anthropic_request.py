"""Anthropic Messages requests: decoding, the conversation checks Anthropic's API makes, and conversion
into a `Conversation`.

Decoding is strict where the policy depends on a field (roles, content blocks, `max_tokens`, which is
required) and lenient elsewhere: `cache_control`, `context_management`, `metadata`, `output_config`,
`container`, `tool_choice` and other fields a local policy cannot honour are accepted and ignored, as
Claude Code sends several of them on every call. A conversation Anthropic's API refuses is refused here
too, with Anthropic's wording and the path of the offending part (`messages.3.content.0`): a
`tool_result` whose `tool_use` is not in the previous message, a `tool_use` not answered in the next
message, a user message or a non-final assistant message with empty content, a block type the API
does not know, a `tool_use` whose `input` is not an object, `max_tokens` below 1. Empty text blocks, which
Anthropic refuses, are accepted: harnesses (gyre's own built-in agent) send an empty reply back that way;
so are empty system-role messages (Claude Code sends one after `/compact`), rendered as an empty ChatML
system turn, as Qwen's chat template renders a system message that is not the first.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from gyre_proxy.chat import Conversation, Kind, RequestError, Sampling, ToolCall, Turn, json_error
from gyre_proxy.msgcache import MessageCache
from gyre_proxy.render import tool_json
from gyre_proxy.strip import Stripper

# Every content block type Anthropic's Messages API (with Claude Code's betas) takes in `messages`, and
# inside a `tool_result`'s content: the `type` literals of the anthropic SDK's (2.14) `BetaContentBlockParam`
# and `BetaToolResultBlockParam.content` unions.
MESSAGE_BLOCK_TYPES = frozenset(
    {
        "advisor_tool_result",
        "bash_code_execution_tool_result",
        "code_execution_tool_result",
        "compaction",
        "container_upload",
        "document",
        "fallback",
        "image",
        "mcp_tool_listing",
        "mcp_tool_result",
        "mcp_tool_use",
        "redacted_thinking",
        "search_result",
        "server_tool_use",
        "text",
        "text_editor_code_execution_tool_result",
        "thinking",
        "tool_addition",
        "tool_removal",
        "tool_result",
        "tool_search_tool_result",
        "tool_use",
        "web_fetch_tool_result",
        "web_search_tool_result",
    }
)
RESULT_BLOCK_TYPES = frozenset(
    {"browser_state", "document", "image", "search_result", "text", "tool_reference"}
)


class ABlock(msgspec.Struct, omit_defaults=True):
    """Any content block; which fields matter depends on `type`."""

    type: str
    text: str | None = None
    thinking: str | None = None
    signature: str | None = None
    id: str | None = None
    name: str | None = None
    input: Any = msgspec.UNSET
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
    max_tokens: int
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


def _request_with(name: str, messages: Any) -> Any:
    """A struct with `ARequest`'s fields, `messages` of type `messages`."""
    return msgspec.defstruct(
        name,
        [
            (f.name, messages if f.name == "messages" else f.type)
            if f.required
            else (f.name, f.type, f.default)
            for f in msgspec.structs.fields(ARequest)
        ],
    )


# `ARequest` with each message left as its raw JSON (decoded one by one, through the cache), and with the
# messages array left whole (a body whose new messages only are decoded: `_decode_appended`)
_ARequestRaw = _request_with("_ARequestRaw", list[msgspec.Raw])
_ARequestArray = _request_with("_ARequestArray", msgspec.Raw)


_req_dec = msgspec.json.Decoder(ARequest)
_count_dec = msgspec.json.Decoder(ACountRequest)
_raw_dec = msgspec.json.Decoder(_ARequestRaw)
_array_dec = msgspec.json.Decoder(_ARequestArray)
_raws_dec = msgspec.json.Decoder(list[msgspec.Raw])
_msg_dec = msgspec.json.Decoder(AMessage)
_WS = b" \t\r\n"  # JSON's whitespace


def _field_of(exc: msgspec.ValidationError) -> str:
    msg = str(exc)
    at = msg.rfind("at `$")
    return msg[at + 5 : msg.rfind("`")].lstrip(".") if at >= 0 else "body"


def decode(body: bytes, count: bool = False) -> ARequest | ACountRequest:
    """The request, checked as Anthropic's API checks it (RequestError otherwise)."""
    try:
        req: ARequest | ACountRequest = (_count_dec if count else _req_dec).decode(body)
    except msgspec.ValidationError as exc:
        raise RequestError(_field_of(exc), str(exc)) from None
    except msgspec.DecodeError as exc:
        raise json_error(exc, body) from None
    check(req)
    return req


@dataclass(frozen=True, slots=True)
class Decoded:
    """A request's messages as decoded, checked and converted, and where they lie in its body: a later
    request whose body starts with the same bytes up to `end` resends them (`decode_conversation`)."""

    body: bytes
    start: int  # offset of the first message
    end: int  # offset just past the last message
    messages: tuple[AMessage, ...]
    turns: tuple[Turn, ...]
    said: int  # index of the last message that is not system-role (-1: none)


def decode_conversation(
    body: bytes, stripper: Stripper, cache: MessageCache, earlier: Sequence[Decoded] | None = None
) -> tuple[ARequest, Conversation, Decoded | None]:
    """`decode` then `to_conversation`, with each message decoded, checked and converted only the first
    time its exact bytes are seen (`cache`), and, when the body starts with the bytes of one of `earlier`
    up to the end of its messages, only the messages after those (the checks then carry on from where
    that request's ended). Anything the fast ways cannot decode, or refuse, is decoded the plain way, so
    the result and every error are what `decode` gives. The third value is this request's, for
    `earlier` of a later one (None when `earlier` is None, or its messages could not be located in the
    body)."""
    prior = _resent(body, earlier) if earlier else None
    if prior is not None:
        try:
            done = _decode_appended(body, prior, stripper, cache)
        except (msgspec.MsgspecError, RequestError):
            done = None
        if done is not None:
            return done
    try:
        raw = _raw_dec.decode(body)
        keys = [bytes(m) for m in raw.messages]
        hits = [cache.get(k) for k in keys]
        messages = [h[0] if h is not None else _msg_dec.decode(k) for k, h in zip(keys, hits, strict=True)]
    except msgspec.MsgspecError:
        req = decode(body)
        assert isinstance(req, ARequest)
        return req, to_conversation(req, stripper), None
    req = _with_messages(raw, messages)
    check(req, checked={i for i, h in enumerate(hits) if h is not None})
    turns = _cached_turns(keys, messages, hits, cache)
    span = _span(raw.messages, body) if earlier is not None else None
    dec = None
    if span is not None:
        dec = Decoded(body, span[0], span[1], tuple(messages), turns, _last_said(messages, 0, -1))
    return req, _conversation(req, turns, stripper), dec


def _resent(body: bytes, earlier: Sequence[Decoded]) -> Decoded | None:
    """The one of `earlier` whose messages' bytes `body` starts with, the longest."""
    best = None
    for d in earlier:
        longer = len(body) > d.end and (best is None or d.end > best.end)
        if longer and body.startswith(memoryview(d.body)[: d.end]):
            best = d
    return best


def _decode_appended(
    body: bytes, prior: Decoded, stripper: Stripper, cache: MessageCache
) -> tuple[ARequest, Conversation, Decoded] | None:
    """The request whose body starts with `prior`'s bytes up to the end of its messages, decoding only what
    follows them: the bytes before its first message, then the rest after the last (a `,` dropped) make
    a request holding only the new messages and every other field. None where that is not the case."""
    rest = body[prior.end :].lstrip(_WS)
    if rest[:1] == b",":
        rest = rest[1:]
        if rest.lstrip(_WS)[:1] in (b"]", b""):  # a trailing comma: not JSON
            return None
    elif rest[:1] != b"]":
        return None
    head = body[: prior.start]
    joined = head + rest
    raw = _array_dec.decode(joined)
    # the messages decoded must be the array opened in `head`, not one of a later `messages` key
    if _address(raw.messages) - _address(joined) != len(head.rstrip(_WS)) - 1:
        return None
    raws = _raws_dec.decode(raw.messages)
    keys = [bytes(m) for m in raws]
    hits = [cache.get(k) for k in keys]
    new = [h[0] if h is not None else _msg_dec.decode(k) for k, h in zip(keys, hits, strict=True)]
    since = len(prior.messages)
    messages = [*prior.messages, *new]
    req = _with_messages(raw, messages)
    check(req, {since + i for i, h in enumerate(hits) if h is not None}, since, prior.said)
    turns = prior.turns + _cached_turns(keys, new, hits, cache)
    end = prior.end
    if raws:
        span = _span(raws, joined)
        if span is None:
            return None
        end = span[1] - len(head) + len(body) - len(rest)
    said = _last_said(messages, since, prior.said)
    dec = Decoded(body, prior.start, end, (*prior.messages, *new), turns, said)
    return req, _conversation(req, turns, stripper), dec


def _with_messages(raw: Any, messages: list[AMessage]) -> ARequest:
    fields = {f: getattr(raw, f) for f in raw.__struct_fields__ if f != "messages"}
    return ARequest(messages=messages, **fields)


def _cached_turns(
    keys: list[bytes], messages: list[AMessage], hits: list[Any], cache: MessageCache
) -> tuple[Turn, ...]:
    turns: list[Turn] = []
    for key, m, hit in zip(keys, messages, hits, strict=True):
        if hit is None:
            made = _message_turns(m)
            cache.put(key, m, made)
            turns += made
        else:
            turns += hit[1]
    return tuple(turns)


def _conversation(req: ARequest, turns: tuple[Turn, ...], stripper: Stripper) -> Conversation:
    system, stripped = _system(req.system, stripper)
    return Conversation(system, _tools(req.tools), turns, _thinking_on(req.thinking), stripped)


def _address(buf: Any) -> int:
    return int(np.frombuffer(buf, np.uint8).ctypes.data)


def _span(raws: list[msgspec.Raw], buf: bytes) -> tuple[int, int] | None:
    """Where the messages `raws` (decoded from `buf`, which they view) lie in `buf`: the offset of the
    first and just past the last; None if they do not lie in it."""
    base = _address(buf)
    start = _address(raws[0]) - base
    end = _address(raws[-1]) - base + len(raws[-1])
    if not 0 <= start < end <= len(buf) or buf[start] != memoryview(raws[0])[0]:
        return None
    return start, end


def _last_said(messages: list[AMessage], since: int, said: int) -> int:
    for i in range(len(messages) - 1, since - 1, -1):
        if messages[i].role != "system":
            return i
    return said


# ------------------------------------------------------------------------------------------- checks


def check(
    req: ARequest | ACountRequest,
    checked: set[int] | frozenset[int] = frozenset(),
    since: int = 0,
    said: int = -1,
) -> None:
    """Anthropic's checks (module docstring); `checked`: messages whose blocks passed before (the same
    bytes: their block checks are skipped); `since`, `said`: the messages before `since` are those of a
    request that passed these checks (the same bytes, nothing after them), the last of them that is not
    system-role at `said` (-1: none), so only what the messages from `since` on can change is checked."""
    if isinstance(req, ARequest):
        if req.max_tokens < 1:
            raise RequestError("max_tokens", f"must be >= 1, got {req.max_tokens}")
        if not req.messages:
            raise RequestError("messages", "at least one message is required")
    if isinstance(req.system, list):
        for j, b in enumerate(req.system):
            if b.type != "text":
                raise RequestError(f"system.{j}.type", f"system blocks are text blocks, got {b.type!r}")
    last = len(req.messages) - 1
    # the earlier request's last message is checked again: it may now be followed by others
    for i in range(max(0, since - 1), last + 1):
        m = req.messages[i]
        if m.role not in ("user", "assistant", "system"):
            raise RequestError(
                f"messages.{i}.role", f"unknown role {m.role!r} (expected user, assistant or system)"
            )
        # Claude Code 2.1.328 sends `{"role": "system", "content": []}` after `/compact` (its real
        # traffic, covered by the real-CLI test): a system-role message may be empty
        if not m.content and m.role != "system" and not (i == last and m.role == "assistant"):
            raise RequestError(
                f"messages.{i}",
                "all messages must have non-empty content except for the optional final assistant message",
            )
        if isinstance(m.content, list) and i not in checked:
            _check_blocks(m.content, f"messages.{i}.content")
    _check_tool_pairs(req.messages, since, said)


def _check_blocks(blocks: list[ABlock], where: str) -> None:
    for j, b in enumerate(blocks):
        at = f"{where}.{j}"
        if b.type not in MESSAGE_BLOCK_TYPES:
            raise RequestError(f"{at}.type", f"unknown content block type {b.type!r}")
        if b.type == "tool_use":
            if not b.id or not b.name:
                raise RequestError(at, "a tool_use block needs id and name")
            if not isinstance(b.input, dict):
                got = "missing" if b.input is msgspec.UNSET else type(b.input).__name__
                raise RequestError(f"{at}.input", f"a tool_use input must be an object, got {got}")
        elif b.type == "tool_result":
            if not b.tool_use_id:
                raise RequestError(f"{at}.tool_use_id", "a tool_result needs tool_use_id")
            for k, inner in enumerate(b.content if isinstance(b.content, list) else []):
                if inner.type not in RESULT_BLOCK_TYPES:
                    raise RequestError(
                        f"{at}.content.{k}.type", f"unknown tool_result content block type {inner.type!r}"
                    )


def _blocks(m: AMessage, kind: str) -> list[tuple[int, ABlock]]:
    return [(j, b) for j, b in enumerate(m.content) if b.type == kind] if isinstance(m.content, list) else []


def _check_tool_pairs(messages: list[AMessage], since: int = 0, said: int = -1) -> None:
    """Each tool_use is answered by a tool_result in the next message, and each tool_result answers a
    tool_use of the previous message (system-role messages in between are passed over). `since`, `said`:
    as `check`'s (the pairs within the messages before `since` passed: only the tool_use of the message at
    `said` and the messages from `since` on are checked)."""
    lo = said if said >= 0 else since
    convo = [(i, m) for i, m in enumerate(messages[lo:], lo) if m.role != "system"]
    for k, (i, m) in enumerate(convo):
        prev = convo[k - 1][1] if k > 0 else None
        asked = {b.id for _, b in _blocks(prev, "tool_use")} if prev and prev.role == "assistant" else set()
        for j, b in _blocks(m, "tool_result") if m.role == "user" and i >= since else []:
            if b.tool_use_id not in asked:
                raise RequestError(
                    f"messages.{i}.content.{j}",
                    f"unexpected `tool_use_id` found in `tool_result` blocks: {b.tool_use_id}. Each "
                    "`tool_result` block must have a corresponding `tool_use` block in the previous message.",
                )
        if m.role != "assistant" or k + 1 == len(convo):
            continue
        nxt = convo[k + 1][1]
        answered = {b.tool_use_id for _, b in _blocks(nxt, "tool_result")} if nxt.role == "user" else set()
        missing = [b.id for _, b in _blocks(m, "tool_use") if b.id not in answered]
        if missing:
            raise RequestError(
                f"messages.{i}",
                f"`tool_use` ids were found without `tool_result` blocks immediately after: "
                f"{', '.join(str(x) for x in missing)}. Each `tool_use` block must have a corresponding "
                "`tool_result` block in the next message.",
            )


# -------------------------------------------------------------------------------------- conversion


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


def _system(system: str | list[ABlock] | None, stripper: Stripper) -> tuple[str, tuple[tuple[str, str], ...]]:
    if system is None:
        return "", ()
    texts = [system] if isinstance(system, str) else [b.text or "" for b in system if b.type == "text"]
    kept, gone = stripper.split(texts)
    return "\n\n".join(kept), gone


def _tools(tools: list[ATool] | None) -> tuple[str, ...]:
    out = []
    for t in tools or []:
        fn: dict[str, Any] = {"name": t.name, "description": t.description}
        fn["parameters"] = (
            t.input_schema if t.input_schema is not None else {"type": "object", "properties": {}}
        )
        out.append(tool_json({"type": "function", "function": fn}))
    return tuple(out)


def _user_turns(content: list[ABlock]) -> list[Turn]:
    turns: list[Turn] = []
    texts: list[str] = []
    for b in content:
        if b.type == "tool_result":
            if texts:
                turns.append(Turn(Kind.USER, "\n\n".join(texts)))
                texts = []
            turns.append(
                Turn(Kind.TOOL, _text_of(b.content), tool_call_id=b.tool_use_id or "", is_error=b.is_error)
            )
        elif b.type == "text":
            texts.append(b.text or "")
        elif b.type in ("image", "document"):
            texts.append(f"[{b.type} omitted]")
    if texts:
        turns.append(Turn(Kind.USER, "\n\n".join(texts)))
    return turns


def _assistant_turn(content: list[ABlock]) -> Turn:
    reasoning, signature, text = [], "", []
    calls: list[ToolCall] = []
    for b in content:
        if b.type == "thinking":
            reasoning.append(b.thinking or "")
            signature = signature or (b.signature or "")
        elif b.type == "text":
            text.append(b.text or "")
        elif b.type == "tool_use":
            calls.append(ToolCall(b.id or "", b.name or "", json.dumps(b.input, ensure_ascii=False)))
    return Turn(Kind.ASSISTANT, "".join(text), "\n".join(reasoning), signature, tuple(calls))


def _message_turns(m: AMessage) -> tuple[Turn, ...]:
    """The turns of one message (a function of that message alone)."""
    if m.role == "system":
        return (Turn(Kind.SYSTEM, _text_of(m.content)),)
    if isinstance(m.content, str):
        return (Turn(Kind.USER if m.role == "user" else Kind.ASSISTANT, m.content),)
    if m.role == "user":
        return tuple(_user_turns(m.content))
    return (_assistant_turn(m.content),)


def _turns(messages: list[AMessage]) -> tuple[Turn, ...]:
    return tuple(t for m in messages for t in _message_turns(m))


def _thinking_on(t: AThinking | None) -> bool:
    return t is not None and t.type in ("enabled", "adaptive")


def to_conversation(req: ARequest | ACountRequest, stripper: Stripper) -> Conversation:
    system, stripped = _system(req.system, stripper)
    return Conversation(system, _tools(req.tools), _turns(req.messages), _thinking_on(req.thinking), stripped)


def to_sampling(req: ARequest) -> Sampling:
    return Sampling(
        req.max_tokens,
        1.0 if req.temperature is None else req.temperature,
        1.0 if req.top_p is None else req.top_p,
        -1 if req.top_k is None else req.top_k,
        tuple(req.stop_sequences or ()),
    )
