"""The API-neutral conversation both front ends (Anthropic, OpenAI) are converted into before rendering.

A `Conversation` is a system text, a tools list (JSON-encoded once) and a tuple of `Turn`s. Turns are
frozen msgspec Structs so that two requests of one execution can be compared turn by turn cheaply (string
equality, no hashing of the whole context). An assistant turn carries the keys (tool-call ids, thinking
signature, text) by which the proxy finds the exact output ids it recorded for it.
"""

from __future__ import annotations

import enum
import re

import msgspec


class Kind(enum.StrEnum):
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"  # one tool result
    SYSTEM = "system"  # a system-role message inside the conversation (not the leading system prompt)


class ToolCall(msgspec.Struct, frozen=True):
    """A tool call as the harness sends it back: its id, the tool's name and the arguments as JSON text."""

    id: str
    name: str
    arguments: str


class Turn(msgspec.Struct, frozen=True):
    kind: Kind
    text: str = ""
    reasoning: str = ""  # assistant thinking text
    signature: str = ""  # assistant thinking signature (the proxy's own, names the call)
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""  # for TOOL turns
    is_error: bool = False  # for TOOL turns


class Conversation(msgspec.Struct, frozen=True):
    system: str
    tools_json: tuple[str, ...]  # each tool as the chat template's `tool | tojson` would print it
    turns: tuple[Turn, ...]
    thinking: bool = False  # the request asked for reasoning (else the prompt opens an empty think block)
    stripped: tuple[tuple[str, str], ...] = ()
    """Harness metadata removed from what the policy sees: (rule name, text), in request order."""


class Sampling(msgspec.Struct, frozen=True):
    """What the harness asked of the sampler; mapped onto SGLang's sampling_params."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    seed: int | None = None  # SGLang `sampling_seed`
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    top_logprobs: int = 0  # alternatives per output token (SGLang `top_logprobs_num`)
    min_new_tokens: int = 0  # SGLang `min_new_tokens` (the end-of-turn token is held back until then)
    ignore_eos: bool = False  # SGLang `ignore_eos`: sample past the end-of-turn token, to the budget


class RequestError(ValueError):
    """A malformed request: answered with HTTP 400 naming `field`."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


_ESCAPE = re.compile(rb"(\\+)u([0-9a-fA-F]{4})")


def lone_surrogate(body: bytes) -> tuple[int, str] | None:
    """(byte offset, escape) of the first `\\uD800`-`\\uDFFF` escape that is not half of a pair, if any.
    Such a string escape is valid JSON syntax but names no Unicode character."""
    pending: tuple[int, str] | None = None  # a high surrogate waiting for its low half
    end_of_pending = -1
    for m in _ESCAPE.finditer(body):
        if len(m.group(1)) % 2 == 0:  # an escaped backslash followed by a literal "u"
            continue
        at = m.start() + len(m.group(1)) - 1
        unit = int(m.group(2), 16)
        if pending is not None and (at != end_of_pending or not 0xDC00 <= unit <= 0xDFFF):
            return pending
        if pending is not None:
            pending = None
            continue
        if 0xD800 <= unit <= 0xDBFF:
            pending, end_of_pending = (at, f"\\u{m.group(2).decode()}"), m.end()
        elif 0xDC00 <= unit <= 0xDFFF:
            return at, f"\\u{m.group(2).decode()}"
    return pending


def json_error(exc: msgspec.DecodeError, body: bytes) -> RequestError:
    """The 400 for a body that is not JSON, naming the real problem where msgspec's message does not."""
    lone = lone_surrogate(body)
    if lone is not None:
        at, esc = lone
        return RequestError(
            "body", f"invalid JSON: lone UTF-16 surrogate {esc} at byte {at} (half of a surrogate pair)"
        )
    return RequestError("body", f"invalid JSON: {exc}")
