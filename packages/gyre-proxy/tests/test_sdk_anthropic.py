"""The official `anthropic` SDK against the proxy and a scripted engine: streaming and not, multi-turn
with tools and thinking; the records hold exactly what the engine returned and later inputs contain it."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import numpy as np
import pytest
from gyre_traj.io import read_records
from gyre_traj.records import Call, Role

TOOLS: list[Any] = [
    {
        "name": "bash",
        "description": "Run a shell command",
        "input_schema": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    }
]


def full_inputs(calls: list[Call]) -> dict[str, np.ndarray]:
    """Each call's input in full, resolving deltas against earlier calls."""
    seq: dict[str, np.ndarray] = {}
    out: dict[str, np.ndarray] = {}
    for c in calls:
        if c.input_ids is not None:
            inp = c.input_ids
        else:
            assert c.input_delta is not None
            d = c.input_delta
            inp = np.concatenate([seq[d.parent][: d.keep], d.append])
        out[c.call_id] = inp
        seq[c.call_id] = np.concatenate([inp, c.output_ids])
    return out


def check_exact(records: list[Call], engine: Any) -> None:
    """Every output id is what the engine returned; each later input is what the engine received and
    contains every earlier output unchanged."""
    inputs = full_inputs(records)
    assert len(records) == len(engine.seen)
    for i, rec in enumerate(records):
        assert rec.output_ids.tolist() == engine.outputs[i]
        assert inputs[rec.call_id].tolist() == engine.seen[i].input_ids
        assert np.allclose(
            rec.output_logprobs, [engine.logprob(j, t) for j, t in enumerate(engine.outputs[i])]
        )
        for earlier in records[:i]:
            if earlier.agent_id != rec.agent_id:
                continue
            s = np.concatenate([inputs[earlier.call_id], earlier.output_ids]).tolist()
            later = inputs[rec.call_id].tolist()
            assert later[: len(s)] == s, "a later input does not extend the earlier call's input + output"


def test_messages_tools_multi_turn_streaming_and_not(engine: Any, make_proxy: Any, request: Any) -> None:
    engine.script = [
        '<think>\nI should list files.\n</think>\n\nLet me look.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>',
        "There are two files.",
        '<tool_call>\n{"name": "bash", "arguments": {"command": "cat a.txt"}}\n</tool_call>',
        "Done: a.txt says hello.",
    ]
    ps = make_proxy([engine.url])
    client = anthropic.Anthropic(base_url=ps.url, api_key="k", max_retries=0)
    request.addfinalizer(client.close)
    msgs: list[Any] = [{"role": "user", "content": "What files are here?"}]
    common: dict[str, Any] = {
        "model": "gyre-policy",
        "max_tokens": 200,
        "tools": TOOLS,
        "system": [{"type": "text", "text": "You are helpful.", "cache_control": {"type": "ephemeral"}}],
        "thinking": {"type": "enabled", "budget_tokens": 100},
        "metadata": {"user_id": "u1"},
    }
    r1 = client.messages.create(messages=msgs, **common, extra_headers={"X-Claude-Code-Session-Id": "s-1"})
    assert [b.type for b in r1.content] == ["thinking", "text", "tool_use"]
    assert r1.stop_reason == "tool_use"
    tu = r1.content[2]
    assert tu.type == "tool_use" and tu.name == "bash" and tu.input == {"command": "ls"}
    assert r1.content[0].type == "thinking" and r1.content[0].thinking == "I should list files."
    msgs += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r1.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": tu.id, "content": "a.txt b.txt"}],
        },
    ]
    with client.messages.stream(
        messages=msgs, **common, extra_headers={"X-Claude-Code-Session-Id": "s-1"}
    ) as st:
        events = [e.type for e in st]
        r2 = st.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_delta" in events and "message_delta" in events
    assert r2.content[0].type == "text" and r2.content[0].text == "There are two files."
    assert r2.stop_reason == "end_turn"
    msgs += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r2.content]},
        {"role": "user", "content": "Show a.txt"},
    ]
    with client.messages.stream(
        messages=msgs, **common, extra_headers={"X-Claude-Code-Session-Id": "s-1"}
    ) as st:
        r3 = st.get_final_message()
    tu3 = r3.content[-1]
    assert tu3.type == "tool_use" and tu3.input == {"command": "cat a.txt"}
    msgs += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r3.content]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": tu3.id,
                    "content": [{"type": "text", "text": "hello"}],
                    "is_error": False,
                }
            ],
        },
    ]
    r4 = client.messages.create(messages=msgs, **common, extra_headers={"X-Claude-Code-Session-Id": "s-1"})
    assert r4.content[0].type == "text" and r4.content[0].text == "Done: a.txt says hello."
    assert r4.usage.output_tokens == len(engine.outputs[3])

    records = [r for r in read_records(ps.log_path) if isinstance(r, Call)]
    assert len(records) == 4
    assert {r.execution_id for r in records} == {"s-1"}
    assert all(r.weight_version == 3 for r in records)
    assert records[0].input_ids is not None and all(r.input_delta is not None for r in records[1:])
    check_exact(records, engine)
    st = client.get("/gyre/stats", cast_to=object)
    assert isinstance(st, dict) and st["recorded_tokens"] > 0


def test_count_tokens_models_and_errors(engine: Any, make_proxy: Any, request: Any) -> None:
    ps = make_proxy([engine.url], api_keys={"key-a": "exec-a"})
    client = anthropic.Anthropic(base_url=ps.url, api_key="key-a", max_retries=0)
    request.addfinalizer(client.close)
    n = client.messages.count_tokens(model="m", messages=[{"role": "user", "content": "hello there"}])
    assert n.input_tokens > 3
    models = client.models.list()
    assert models.data[0].id == "gyre-policy"
    bad = anthropic.Anthropic(base_url=ps.url, api_key="wrong", max_retries=0)
    request.addfinalizer(bad.close)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    raw = httpx.post(
        f"{ps.url}/v1/messages",
        json={"model": "m", "max_tokens": "many", "messages": [{"role": "user", "content": "x"}]},
        headers={"x-api-key": "key-a"},
    )
    assert raw.status_code == 400
    assert raw.json()["type"] == "error" and raw.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in raw.json()["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="m", max_tokens=5, messages=[{"role": "robot", "content": "x"}])  # type: ignore[typeddict-item]
    assert "messages.0.role" in str(e.value)
    with pytest.raises(anthropic.APIStatusError) as e2:
        client.messages.create(
            model="m", max_tokens=5, messages=[{"role": "user", "content": "word " * 50000}]
        )
    assert e2.value.status_code == 413
    # system-role message inside messages, context_management and other fields it cannot honour
    engine.script = ["fine"]
    r = client.messages.create(
        model="m",
        max_tokens=20,
        messages=[{"role": "user", "content": "hi"}, {"role": "system", "content": "be brief"}],  # type: ignore[list-item]
        extra_body={"context_management": {"edits": []}, "output_config": {"effort": "low"}},
        extra_headers={"anthropic-beta": "context-management-2025-06-27"},
    )
    assert r.content[0].type == "text" and r.content[0].text == "fine"
    rec = [c for c in read_records(ps.log_path) if isinstance(c, Call)]
    assert rec[-1].execution_id == "exec-a" and rec[-1].role is Role.MAIN


def test_overloaded_when_no_engine(make_proxy: Any, request: Any) -> None:
    ps = make_proxy([], pick_wait_s=0.2)
    client = anthropic.Anthropic(base_url=ps.url, api_key="k", max_retries=0)
    request.addfinalizer(client.close)
    with pytest.raises(anthropic.APIStatusError) as e:
        client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 529
    assert e.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]


def test_malformed_tool_call_is_text_and_path_prefix(engine: Any, make_proxy: Any, request: Any) -> None:
    engine.script = [
        '<tool_call>\n{"name": "bash", "arguments": {"command": \n</tool_call>',
        "<tool_call>{broken",
    ]
    ps = make_proxy([engine.url])
    client = anthropic.Anthropic(base_url=f"{ps.url}/e/run-7", api_key="k", max_retries=0)
    request.addfinalizer(client.close)
    r = client.messages.create(
        model="m", max_tokens=100, tools=TOOLS, messages=[{"role": "user", "content": "go"}]
    )
    assert r.stop_reason == "end_turn" and r.content[0].type == "text" and "<tool_call>" in r.content[0].text
    with client.messages.stream(
        model="m", max_tokens=100, tools=TOOLS, messages=[{"role": "user", "content": "again"}]
    ) as st:
        r2 = st.get_final_message()
    assert r2.content[0].type == "text" and r2.content[0].text == "<tool_call>{broken"
    recs = [c for c in read_records(ps.log_path) if isinstance(c, Call)]
    assert [c.execution_id for c in recs] == ["run-7", "run-7"]


def test_stop_sequence_and_engine_rejection(engine: Any, make_proxy: Any, request: Any) -> None:
    engine.script = ["alpha beta STOP gamma"]
    ps = make_proxy([engine.url])
    client = anthropic.Anthropic(base_url=ps.url, api_key="k", max_retries=0)
    request.addfinalizer(client.close)
    r = client.messages.create(
        model="m", max_tokens=50, stop_sequences=["STOP"], messages=[{"role": "user", "content": "go"}]
    )
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == "STOP"
    assert r.content[0].type == "text" and r.content[0].text == "alpha beta "
    rec = [c for c in read_records(ps.log_path) if isinstance(c, Call)][-1]
    assert rec.output_ids.tolist() == engine.outputs[0]  # the sampled ids, stop string included
    engine.reject_next = True
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert "engine refused" in str(e.value)


def test_sse_event_sequence(engine: Any, make_proxy: Any) -> None:
    """The raw event stream: thinking (with its signature), text and tool_use blocks in order."""
    engine.script = [
        '<think>\nplan\n</think>\n\nRunning it.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
    ]
    ps = make_proxy([engine.url])
    body = {
        "model": "m",
        "max_tokens": 100,
        "stream": True,
        "tools": TOOLS,
        "thinking": {"type": "enabled", "budget_tokens": 50},
        "messages": [{"role": "user", "content": "go"}],
    }
    events: list[tuple[str, Any]] = []
    with httpx.stream("POST", f"{ps.url}/v1/messages?beta=true", json=body, headers={"x-api-key": "k"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = ""
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[6:])))
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    starts = [d["content_block"]["type"] for n, d in events if n == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    deltas = [d["delta"]["type"] for n, d in events if n == "content_block_delta"]
    assert deltas.index("signature_delta") < deltas.index("text_delta") < deltas.index("input_json_delta")
    thinking = "".join(
        d["delta"].get("thinking", "") for n, d in events if n == "content_block_delta" and d["index"] == 0
    )
    assert thinking == "plan"
    tool = [
        d["delta"]["partial_json"]
        for n, d in events
        if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta"
    ]
    assert json.loads("".join(tool)) == {"command": "ls"}
    assert [d["index"] for n, d in events if n == "content_block_stop"] == [0, 1, 2]
    final = events[-2][1]
    assert final["delta"]["stop_reason"] == "tool_use" and final["usage"]["output_tokens"] == len(
        engine.outputs[0]
    )


def _fork_pair(url: str, main_out: list[Any]) -> tuple[Any, Any]:
    """A main call and a fork's first call, shaped as Claude Code 2.1.328 sends them (captured): the same
    system blocks but the billing block, the fork sees the main loop's tool_use of its own fork only, and
    names itself in `x-claude-code-agent-id`."""
    head = {"user-agent": "claude-cli/2.1.328 (external, sdk-cli)", "x-claude-code-session-id": "cc-s"}
    billing = "x-anthropic-billing-header: cc_version=2.1.328.d9f; cc_entrypoint=sdk-cli;"
    system = [
        {"type": "text", "text": "You are a Claude agent, built on Anthropic's Claude Agent SDK."},
        {"type": "text", "text": "Harness rules. " * 40, "cache_control": {"type": "ephemeral"}},
    ]
    user = {"role": "user", "content": [{"type": "text", "text": "use two forks"}]}
    body = {"model": "m", "max_tokens": 200, "tools": TOOLS, "stream": True, "messages": [user]}
    main = httpx.post(
        f"{url}/v1/messages?beta=true",
        json={**body, "system": [{"type": "text", "text": billing}, *system]},
        headers=head,
    )
    assert main.status_code == 200
    tid = next(
        json.loads(line[6:])["content_block"]["id"] for line in main.text.splitlines() if '"tool_use"' in line
    )
    tu = {"type": "tool_use", "id": tid, "name": "bash", "input": {"command": "fork one"}}
    result = {
        "type": "tool_result",
        "tool_use_id": tid,
        "content": [{"type": "text", "text": "Fork started"}],
    }
    fork_msgs = [
        user,
        {"role": "assistant", "content": [tu]},
        {"role": "user", "content": [result, {"type": "text", "text": "<fork-boilerplate>say done"}]},
    ]
    sub_billing = billing + " cc_is_subagent=true;"
    fork = httpx.post(
        f"{url}/v1/messages?beta=true",
        json={**body, "messages": fork_msgs, "system": [{"type": "text", "text": sub_billing}, *system]},
        headers={**head, "x-claude-code-agent-id": "a2269319c7e0c3615"},
    )
    assert fork.status_code == 200
    return main, fork


def test_a_forks_first_call_shares_the_main_loops_whole_prefix(
    engine: Any, make_proxy: Any, tokenizer: Any
) -> None:
    """Claude Code's billing block differs between the main loop and its forks; stripped from what the
    policy sees (kept in the record's metadata), a fork's first input is the main loop's input + output
    and more. With no strip rules, the two part at the billing block's first differing token."""
    calls = '<tool_call>\n{"name": "bash", "arguments": {"command": "fork one"}}\n</tool_call>'
    for rules, shared_all in ((None, True), ((), False)):
        engine.script = [f"{calls}\n{calls.replace('one', 'two')}", "All done."]
        kw = {} if rules is None else {"strip_rules": rules}
        ps = make_proxy([engine.url], **kw)
        _fork_pair(ps.url, [])
        main, fork = _records_of(ps)
        main_full = engine.seen[-2].input_ids + engine.outputs[-2]
        fork_in = engine.seen[-1].input_ids
        assert (fork_in[: len(main_full)] == main_full) is shared_all
        assert (main.agent_id, fork.agent_id) == ("main", "a2269319c7e0c3615")
        if shared_all:
            assert fork.input_delta is not None and fork.input_delta.parent == main.call_id
            assert fork.input_delta.keep == len(main_full)
            assert main.metadata["stripped.claude-code-billing"].endswith("cc_entrypoint=sdk-cli;")
            assert fork.metadata["stripped.claude-code-billing"].endswith("cc_is_subagent=true;")
        else:  # they part inside the billing line, the first block of the system prompt
            assert not [k for k in main.metadata if k.startswith("stripped.")]  # nothing stripped
            part = next(i for i, (a, b) in enumerate(zip(fork_in, main_full, strict=False)) if a != b)
            head = "<|im_start|>system\nx-anthropic-billing-header: cc_version=2.1.328.d9f; cc_entrypoint=sdk-cli;"
            assert 0 < part <= len(tokenizer.encode(head, add_special_tokens=False).ids)


def _records_of(ps: Any) -> list[Call]:
    return [r for r in read_records(ps.log_path) if isinstance(r, Call)]
