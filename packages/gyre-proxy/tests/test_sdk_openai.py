"""The official `openai` SDK against the proxy and a scripted engine: chat completions, streaming and not,
multi-turn with tool calls; records exact; errors in OpenAI's shape."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import openai
import pytest
from gyre_traj.io import read_records
from gyre_traj.records import Call

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    }
]


def test_chat_completions_tools_stream_and_not(engine: Any, make_proxy: Any, request: Any) -> None:
    engine.script = [
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.txt"}}\n</tool_call>',
        "<think>\nshort\n</think>\n\nIt says hi.",
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "b.txt"}}\n</tool_call>\n<tool_call>\n{"name": "read_file", "arguments": {"path": "c.txt"}}\n</tool_call>',
        "Both empty.",
    ]
    ps = make_proxy([engine.url])
    client = openai.OpenAI(base_url=f"{ps.url}/e/oa-1/v1", api_key="k", max_retries=0)
    request.addfinalizer(client.close)
    msgs: list[Any] = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Read a.txt"}]
    r1 = client.chat.completions.create(model="gyre-policy", messages=msgs, tools=TOOLS, max_tokens=100)
    ch = r1.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls
    tc = ch.message.tool_calls[0]
    assert tc.type == "function" and tc.function.name == "read_file"
    assert json.loads(tc.function.arguments) == {"path": "a.txt"}
    msgs += [
        ch.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": tc.id, "content": "hi"},
    ]
    stream = client.chat.completions.create(
        model="gyre-policy", messages=msgs, tools=TOOLS, stream=True, stream_options={"include_usage": True}
    )
    content, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
    assert content == "It says hi." and finish == "stop"
    assert usage is not None and usage.completion_tokens == len(engine.outputs[1])
    msgs += [{"role": "assistant", "content": content}, {"role": "user", "content": "now b and c"}]
    stream = client.chat.completions.create(model="gyre-policy", messages=msgs, tools=TOOLS, stream=True)
    calls: dict[int, dict[str, str]] = {}
    for chunk in stream:
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                slot = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] += d.id or ""
                slot["name"] += (d.function.name or "") if d.function else ""
                slot["arguments"] += (d.function.arguments or "") if d.function else ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 2
    assert [json.loads(calls[i]["arguments"])["path"] for i in (0, 1)] == ["b.txt", "c.txt"]
    msgs += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": calls[i]["id"],
                    "type": "function",
                    "function": {"name": calls[i]["name"], "arguments": calls[i]["arguments"]},
                }
                for i in (0, 1)
            ],
        },
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": ""},
        {"role": "tool", "tool_call_id": calls[1]["id"], "content": ""},
    ]
    r4 = client.chat.completions.create(model="gyre-policy", messages=msgs, tools=TOOLS)
    assert r4.choices[0].message.content == "Both empty."
    assert [m.id for m in client.models.list()] == ["gyre-policy"]

    recs = [r for r in read_records(ps.log_path) if isinstance(r, Call)]
    assert [r.execution_id for r in recs] == ["oa-1"] * 4
    # exactness: each input is what the engine saw, and extends the previous input + output
    seq: dict[str, np.ndarray] = {}
    for i, r in enumerate(recs):
        if r.input_ids is not None:
            inp = r.input_ids
        else:
            assert r.input_delta is not None
            inp = np.concatenate([seq[r.input_delta.parent][: r.input_delta.keep], r.input_delta.append])
        assert inp.tolist() == engine.seen[i].input_ids
        assert r.output_ids.tolist() == engine.outputs[i]
        if i:
            prev = seq[recs[i - 1].call_id].tolist()
            assert inp.tolist()[: len(prev)] == prev
        seq[r.call_id] = np.concatenate([inp, r.output_ids])


def test_openai_errors(engine: Any, make_proxy: Any, request: Any) -> None:
    ps = make_proxy([], pick_wait_s=0.2)
    client = openai.OpenAI(base_url=f"{ps.url}/v1", api_key="k", max_retries=0)
    request.addfinalizer(client.close)
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 503
    with pytest.raises(openai.BadRequestError) as e2:
        client.chat.completions.create(model="m", messages=[{"role": "tool", "content": "x"}])  # type: ignore[list-item, typeddict-item]
    body: Any = e2.value.body
    assert body["param"] == "messages.0.tool_call_id"
