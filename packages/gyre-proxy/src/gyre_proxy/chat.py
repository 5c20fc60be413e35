"""The API-neutral conversation both front ends (Anthropic, OpenAI) are converted into before rendering.

A `Conversation` is a system text, a tools list (JSON-encoded once) and a tuple of `Turn`s. Turns are
frozen msgspec Structs so that two requests of one execution can be compared turn by turn cheaply (string
equality, no hashing of the whole context). An assistant turn carries the keys (tool-call ids, thinking
signature, text) by which the proxy finds the exact output ids it recorded for it.
"""

from __future__ import annotations

import enum

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


class Sampling(msgspec.Struct, frozen=True):
    """What the harness asked of the sampler; mapped onto SGLang's sampling_params."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()


class RequestError(ValueError):
    """A malformed request: answered with HTTP 400 naming `field`."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
