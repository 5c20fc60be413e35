"""Conversations the APIs refuse are refused: a 400 in each API's error shape naming what is wrong, with
nothing run on the engine and nothing recorded. Anthropic's wording is the API's own (its refusals as
Claude Code and other clients report them); what the API accepts (a system-role message between a
tool_use and its result, an empty final assistant message) still passes."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from gyre_traj.io import read_records

TOOL_USE = {"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {"command": "ls"}}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.txt"}
ASK = {"role": "user", "content": "go"}

ANTHROPIC_BAD = [
    (
        [ASK, {"role": "assistant", "content": "ok"}, {"role": "user", "content": [RESULT]}],
        "messages.2.content.0",
        "unexpected `tool_use_id` found in `tool_result` blocks: toolu_1",
    ),
    (
        [ASK, {"role": "assistant", "content": [TOOL_USE]}, {"role": "user", "content": "and?"}],
        "messages.1",
        "`tool_use` ids were found without `tool_result` blocks immediately after: toolu_1",
    ),
    ([{"role": "user", "content": ""}], "messages.0", "non-empty content"),
    ([ASK, {"role": "assistant", "content": []}, ASK], "messages.1", "non-empty content"),
    (
        [{"role": "user", "content": [{"type": "pictogram", "text": "x"}]}],
        "messages.0.content.0.type",
        "pictogram",
    ),
    (
        [
            ASK,
            {"role": "assistant", "content": [{**TOOL_USE, "input": "ls"}]},
            {"role": "user", "content": [RESULT]},
        ],
        "messages.1.content.0.input",
        "must be an object, got str",
    ),
    (
        [{"role": "user", "content": [{**RESULT, "content": [{"type": "video", "url": "x"}]}]}],
        "messages.0.content.0.content.0.type",
        "video",
    ),
]


def _no_trace(engine: Any, log_path: Any) -> None:
    assert engine.seen == []
    assert not log_path.exists() or list(read_records(log_path)) == []


def test_anthropic_refuses_what_the_api_refuses(engine: Any, make_proxy: Any) -> None:
    ps = make_proxy([engine.url])
    for messages, where, says in ANTHROPIC_BAD:
        r = httpx.post(f"{ps.url}/v1/messages", json={"model": "m", "max_tokens": 20, "messages": messages})
        assert r.status_code == 400, r.text
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert err["error"]["message"].startswith(f"{where}: ") and says in err["error"]["message"], err
    _no_trace(engine, ps.log_path)


def test_anthropic_accepts_what_the_api_accepts(engine: Any, make_proxy: Any) -> None:
    engine.script = ["fine", "fine"]
    ps = make_proxy([engine.url])
    between = [
        ASK,
        {"role": "assistant", "content": [TOOL_USE]},
        {"role": "system", "content": "a reminder"},
        {"role": "user", "content": [RESULT]},
    ]
    prefill = [ASK, {"role": "assistant", "content": []}]
    for messages in (between, prefill):
        r = httpx.post(f"{ps.url}/v1/messages", json={"model": "m", "max_tokens": 20, "messages": messages})
        assert r.status_code == 200, r.text
    assert len(engine.seen) == 2


def test_an_empty_system_message_after_compact_is_rendered_as_the_template_does(
    engine: Any, make_proxy: Any, tokenizer: Any
) -> None:
    """Claude Code 2.1.328's first call of a session continued after `/compact` (its shape as captured):
    the summary as a user message, then `{"role": "system", "content": []}`. It is accepted, rendered as
    Qwen's template renders a system message that is not the first (an empty ChatML system turn), and
    the record holds exactly what the engine received; an empty user message is still refused."""
    engine.script = ["fine"]
    ps = make_proxy([engine.url])
    messages = [
        {"role": "user", "content": "This session is being continued from a previous conversation."},
        {"role": "system", "content": []},
        {"role": "user", "content": [{"type": "text", "text": "and now?"}]},
    ]
    r = httpx.post(f"{ps.url}/v1/messages", json={"model": "m", "max_tokens": 20, "messages": messages})
    assert r.status_code == 200, r.text
    text = tokenizer.decode(engine.seen[0].input_ids, skip_special_tokens=False)
    assert "conversation.<|im_end|>\n<|im_start|>system\n<|im_end|>\n<|im_start|>user\nand now?" in text
    (rec,) = list(read_records(ps.log_path))
    assert rec.input_ids is not None and rec.input_ids.tolist() == engine.seen[0].input_ids
    bad = [{"role": "user", "content": []}, {"role": "system", "content": []}]
    r = httpx.post(f"{ps.url}/v1/messages", json={"model": "m", "max_tokens": 20, "messages": bad})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages.0: "), r.text


@pytest.mark.parametrize("api", ["anthropic", "openai"])
def test_lone_surrogate_and_max_tokens_zero(engine: Any, make_proxy: Any, api: str) -> None:
    ps = make_proxy([engine.url])
    path = "/v1/messages" if api == "anthropic" else "/v1/chat/completions"
    # msgspec reports these as "Input data was truncated" and "invalid utf-16 surrogate pair"
    for text, esc in ((b"bad\\ud800", "\\ud800"), (b"\\udc00 alone", "\\udc00")):
        raw = b'{"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": "' + text + b'"}]}'
        r = httpx.post(f"{ps.url}{path}", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400
        msg = r.json()["error"]["message"]
        at = raw.index(esc.encode())
        assert f"lone UTF-16 surrogate {esc} at byte {at}" in msg and "truncated" not in msg, msg
    fields = ["max_tokens"] if api == "anthropic" else ["max_tokens", "max_completion_tokens"]
    for field in fields:
        body = {"model": "m", field: 0, "messages": [ASK]}
        r = httpx.post(f"{ps.url}{path}", json=body)
        assert r.status_code == 400 and field in r.text and "must be >= 1" in r.text
    _no_trace(engine, ps.log_path)


CALL = {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}
OPENAI_BAD = [
    (
        [ASK, {"role": "tool", "tool_call_id": "call_1", "content": "x"}],
        "messages.1",
        "must answer a tool call",
    ),
    (
        [ASK, {"role": "assistant", "content": None, "tool_calls": [CALL]}, ASK],
        "messages.1",
        "these had none: call_1",
    ),
    ([{"role": "user", "content": None}], "messages.0.content", "got null"),
    ([ASK, {"role": "assistant", "content": None}, ASK], "messages.1.content", "got null"),
    ([{"role": "user", "content": [{"type": "pictogram"}]}], "messages.0.content.0.type", "pictogram"),
    (
        [
            ASK,
            {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "bash", "arguments": "[1]"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "x"},
        ],
        "messages.1.tool_calls.0.function.arguments",
        "must be a JSON object",
    ),
]
OPENAI_UNSUPPORTED = [
    ({"n": 2}, "n"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logit_bias": {"abc": 1}}, "logit_bias.abc"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias.99999999"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"functions": []}, "functions"),
    ({"frobnicate": True}, "frobnicate"),
]


def test_openai_refuses_invalid_and_unsupported(engine: Any, make_proxy: Any) -> None:
    ps = make_proxy([engine.url])
    cases = [(m, p, s, {}) for m, p, s in OPENAI_BAD] + [([ASK], p, p, e) for e, p in OPENAI_UNSUPPORTED]
    for messages, param, says, extra in cases:
        r = httpx.post(f"{ps.url}/v1/chat/completions", json={"model": "m", "messages": messages, **extra})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, err
        assert err["message"].startswith(f"{param}: ") and says in err["message"], err
    _no_trace(engine, ps.log_path)
