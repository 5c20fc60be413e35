"""The renderer against the model's own Jinja chat template (transformers' apply_chat_template), its
incremental reuse, exact replacement of recorded turns, and the tool-call parser's invariants."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from gyre_proxy.chat import Conversation, Kind, ToolCall, Turn
from gyre_proxy.render import ExecutionCache, Renderer, tool_json
from gyre_proxy.toolparse import BlockKind, parse
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

TOOL = {
    "type": "function",
    "function": {"name": "bash", "description": "Run", "parameters": {"type": "object"}},
}


def _hf_messages(conv: Conversation) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": conv.system}] if conv.system else []
    for t in conv.turns:
        if t.kind is Kind.USER:
            msgs.append({"role": "user", "content": t.text})
        elif t.kind is Kind.TOOL:
            msgs.append({"role": "tool", "content": t.text})
        else:
            m: dict[str, Any] = {"role": "assistant", "content": t.text}
            if t.reasoning:
                m["reasoning_content"] = t.reasoning
            if t.tool_calls:
                m["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": json.loads(c.arguments)},
                    }
                    for c in t.tool_calls
                ]
            msgs.append(m)
    return msgs


CONVS = [
    Conversation("", (), (Turn(Kind.USER, "hello"),), thinking=True),
    Conversation(
        "Be brief.", (), (Turn(Kind.USER, "hi"), Turn(Kind.ASSISTANT, "hey"), Turn(Kind.USER, "bye"))
    ),
    Conversation(
        "sys",
        (tool_json(TOOL),),
        (
            Turn(Kind.USER, "list files"),
            Turn(
                Kind.ASSISTANT, "ok", "think first", tool_calls=(ToolCall("t1", "bash", '{"command": "ls"}'),)
            ),
            Turn(Kind.TOOL, "a.txt", tool_call_id="t1"),
            Turn(
                Kind.ASSISTANT,
                "",
                tool_calls=(ToolCall("t2", "bash", '{"command": "cat a.txt"}'), ToolCall("t3", "bash", "{}")),
            ),
            Turn(Kind.TOOL, "hi", tool_call_id="t2"),
            Turn(Kind.TOOL, "", tool_call_id="t3"),
        ),
        thinking=True,
    ),
    Conversation(
        "",
        (tool_json(TOOL),),
        (Turn(Kind.USER, "x"), Turn(Kind.ASSISTANT, "y", "old thought"), Turn(Kind.USER, "z")),
    ),
]


def test_matches_the_models_jinja_template(tokenizer_dir: Path, tokenizer: Tokenizer) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    r = Renderer(tokenizer)
    for conv in CONVS:
        tools = [json.loads(t) for t in conv.tools_json] or None
        want = hf.apply_chat_template(
            _hf_messages(conv),
            tools=tools,
            add_generation_prompt=True,
            tokenize=False,
            enable_thinking=conv.thinking,
        )
        assert r.full_text(conv) == want
        rendered, _ = r.render(conv, ExecutionCache())
        assert rendered.ids().tolist() == tokenizer.encode(want, add_special_tokens=False).ids


def test_incremental_reuse_and_recorded_turns(tokenizer: Tokenizer) -> None:
    r = Renderer(tokenizer)
    ex = ExecutionCache()
    turns: list[Turn] = [Turn(Kind.USER, "first question " * 50)]
    conv = Conversation("system prompt", (tool_json(TOOL),), tuple(turns))
    first, _ = r.render(conv, ex)
    assert first.reused_tokens == 0 and first.tokenized_tokens == first.n_tokens
    # the model "sampled" these ids, which do not re-tokenize to themselves
    odd = np.asarray([*tokenizer.encode("Sure", add_special_tokens=False).ids, 207, 207, 2], np.int32)
    rec = r.record_output(ex, "c1", first.gen_prompt, odd, [], "", "Sure")
    turns += [Turn(Kind.ASSISTANT, "Sure"), Turn(Kind.USER, "next")]
    second, _ = r.render(Conversation("system prompt", (tool_json(TOOL),), tuple(turns)), ex)
    ids = second.ids().tolist()
    prev = first.ids().tolist() + odd.tolist()
    assert ids[: len(prev)] == prev  # the earlier input and the exact output, unchanged
    assert second.recorded_tokens == rec.segment.ids.size
    assert second.reused_tokens == first.n_tokens - first.gen_prompt.size
    assert second.tokenized_tokens < 20  # only "next" and the generation prompt were tokenized


def test_system_role_message_and_errors(tokenizer: Tokenizer) -> None:
    r = Renderer(tokenizer)
    conv = Conversation(
        "",
        (),
        (
            Turn(Kind.USER, "a"),
            Turn(Kind.SYSTEM, "note"),
            Turn(Kind.TOOL, "boom", tool_call_id="x", is_error=True),
        ),
    )
    text = r.full_text(conv)
    assert "<|im_start|>system\nnote<|im_end|>" in text and "Error: boom" in text


@given(
    st.lists(
        st.sampled_from(
            [
                "<think>",
                "</think>",
                "<tool_call>",
                "</tool_call>",
                '{"name": "f", "arguments": {}}',
                "hi",
                "\n",
                "{",
                "<tool",
                "_call>",
            ]
        ),
        max_size=12,
    )
)
@settings(max_examples=300, deadline=None)
def test_parser_never_fails_and_streaming_only_grows(pieces: list[str]) -> None:
    text = "".join(pieces)
    final = parse(text, final=True)
    for b in final:
        if b.kind is BlockKind.TOOL:
            assert isinstance(json.loads(b.text), dict) and b.name
    prev: list[Any] = []
    for k in range(len(text) + 1):
        cur = parse(text[:k], final=False)
        # blocks never change kind once emitted, and only the last one grows
        for i, b in enumerate(prev[:-1]):
            assert cur[i] == b
        if prev:
            assert cur[len(prev) - 1].kind is prev[-1].kind
        prev = cur


def test_parser_examples() -> None:
    blocks = parse(
        '<think>\nhmm\n</think>\n\nok\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>'
    )
    assert [(b.kind, b.text, b.name) for b in blocks] == [
        (BlockKind.THINKING, "hmm", ""),
        (BlockKind.TEXT, "ok", ""),
        (BlockKind.TOOL, '{"command": "ls"}', "bash"),
    ]
    assert parse("<tool_call>not json</tool_call>")[0].kind is BlockKind.TEXT
    assert parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')[0].text == '{"a": 1}'


@given(
    st.lists(st.sampled_from(["a", "é", "漢", "🙂", " ", "\n", "<think>", "x"]), max_size=40).map("".join),
    st.integers(1, 5),
)
@settings(max_examples=100, deadline=None)
def test_incremental_text_equals_full_decode(tokenizer: Tokenizer, text: str, step: int) -> None:
    from gyre_proxy.core import IncrementalText

    ids = tokenizer.encode(text, add_special_tokens=False).ids
    inc = IncrementalText(tokenizer)
    for k in range(0, len(ids) + step, step):
        assert inc.text(ids[:k]) == tokenizer.decode(ids[:k], skip_special_tokens=False)


_TEXTS = st.sampled_from(["hi", "list files", "é漢🙂", "a\nb", "  spaced  ", "<tool_call>x", "x" * 50, ""])


@st.composite
def _turn(draw: st.DrawFn) -> Turn:
    kind = draw(st.sampled_from([Kind.USER, Kind.ASSISTANT, Kind.TOOL, Kind.SYSTEM]))
    text = draw(_TEXTS)
    if kind is Kind.ASSISTANT:
        calls = tuple(ToolCall(f"t{i}", "bash", '{"c": 1}') for i in range(draw(st.integers(0, 2))))
        return Turn(kind, text, draw(st.sampled_from(["", "thinking"])), tool_calls=calls)
    if kind is Kind.TOOL:
        return Turn(kind, text, tool_call_id="t0", is_error=draw(st.booleans()))
    return Turn(kind, text)


@given(
    st.lists(_turn(), min_size=1, max_size=8),
    st.lists(
        st.tuples(
            st.sampled_from(["append", "edit", "truncate", "tools", "thinking"]), st.integers(0, 7), _turn()
        ),
        max_size=6,
    ),
)
@settings(max_examples=150, deadline=None)
def test_incremental_render_equals_a_fresh_full_render(
    tokenizer: Tokenizer, turns: list[Turn], edits: list[Any]
) -> None:
    """Without recorded turns, every incremental render (after appends, edits, truncations, tool-list and
    thinking changes) gives exactly the ids of tokenizing the whole prompt text from scratch."""
    r = Renderer(tokenizer)
    ex = ExecutionCache()
    tools: tuple[str, ...] = ()
    thinking = False
    turns = list(turns)
    for op, at, t in [("start", 0, turns[0]), *edits]:
        if op == "append":
            turns.append(t)
        elif op == "edit":
            turns[at % len(turns)] = t
        elif op == "truncate" and len(turns) > 1:
            turns = turns[: 1 + at % (len(turns) - 1)]
        elif op == "tools":
            tools = () if tools else (tool_json(TOOL),)
        elif op == "thinking":
            thinking = not thinking
        conv = Conversation("sys", tools, tuple(turns), thinking)
        rendered, _ = r.render(conv, ex)
        assert rendered.ids().tolist() == tokenizer.encode(r.full_text(conv), add_special_tokens=False).ids


def test_same_text_twice_maps_to_each_own_output(tokenizer: Tokenizer) -> None:
    """Two assistant turns with the same text are two calls with different sampled ids: each keeps its own."""
    r = Renderer(tokenizer)
    ex = ExecutionCache()
    ok = tokenizer.encode("OK", add_special_tokens=False).ids
    turns: list[Turn] = [Turn(Kind.USER, "a")]
    first, _ = r.render(Conversation("", (), tuple(turns)), ex)
    out1 = np.asarray([*ok, 207, 2], np.int32)
    r.record_output(ex, "c1", first.gen_prompt, out1, [], "", "OK", context=first.context, position=1)
    turns += [Turn(Kind.ASSISTANT, "OK"), Turn(Kind.USER, "b")]
    second, _ = r.render(Conversation("", (), tuple(turns)), ex)
    out2 = np.asarray([*ok, 2], np.int32)
    r.record_output(ex, "c2", second.gen_prompt, out2, [], "", "OK", context=second.context, position=3)
    turns += [Turn(Kind.ASSISTANT, "OK"), Turn(Kind.USER, "c")]
    # the same conversation: each turn is found as the output of exactly the conversation before it
    same, _ = r.render(Conversation("", (), tuple(turns)), ex)
    assert same.ambiguous == 0
    # a fresh cache for this agent (say, after its system prompt changed): both turns are looked up again,
    # each at its own conversation position
    third, _ = r.render(Conversation("other system", (), tuple(turns)), ex)
    assert third.ambiguous == 0
    ids = third.ids().tolist()
    seg1 = [*first.gen_prompt.tolist(), *ok, 207, 2, *r.newline.tolist()]
    seg2 = [*second.gen_prompt.tolist(), *ok, 2, *r.newline.tolist()]
    assert third.recorded_tokens == len(seg1) + len(seg2)
    s = " ".join(map(str, ids))
    assert s.index(" ".join(map(str, seg1))) < s.index(" ".join(map(str, seg2)))


def test_evicted_render_cache_keeps_recorded_outputs(tokenizer_dir: Path, tokenizer: Tokenizer) -> None:
    from gyre_proxy.config import ProxyConfig
    from gyre_proxy.core import Proxy

    proxy = Proxy(ProxyConfig(tokenizer=str(tokenizer_dir), max_executions=2), tokenizer)
    ex = proxy.execution("a")
    conv = Conversation("", (), (Turn(Kind.USER, "q"),))
    first, _ = proxy.renderer.render(conv, ex)
    proxy.renderer.record_output(ex, "c1", first.gen_prompt, np.asarray([5, 6, 2], np.int32), ["t1"], "", "")
    for other in ("b", "c", "d"):
        proxy.execution(other)
    assert not proxy.executions["a"].agents and "t1" in proxy.executions["a"].by_tool_id
    turns = (
        *conv.turns,
        Turn(Kind.ASSISTANT, "", tool_calls=(ToolCall("t1", "bash", "{}"),)),
        Turn(Kind.TOOL, "ok"),
    )
    again, _ = proxy.renderer.render(Conversation("", (), turns), proxy.execution("a"))
    assert again.recorded_tokens > 0 and again.ids().tolist()[first.n_tokens : first.n_tokens + 3] == [
        5,
        6,
        2,
    ]


def test_same_text_from_two_agents_keeps_each_agents_ids(tokenizer: Tokenizer) -> None:
    """A fork and the main loop answer the same text with other ids. The main loop's next request (no
    thinking block to find it by) gets the main loop's ids: the output generated from exactly the
    conversation before the turn, else the agent's own. Two outputs with different ids from one and the
    same conversation (a retried call) are an ambiguity: counted, and the turn is tokenized from its text
    instead of taking either call's ids."""
    r = Renderer(tokenizer)
    ex = ExecutionCache()
    done = tokenizer.encode("All done.", add_special_tokens=False).ids
    spelled = [i for ch in "All done." for i in tokenizer.encode(ch, add_special_tokens=False).ids]
    main_conv = Conversation("sys", (), (Turn(Kind.USER, "task"),))
    fork_conv = Conversation("sys", (), (Turn(Kind.USER, "task"), Turn(Kind.USER, "you are a fork")))
    fork, _ = r.render(fork_conv, ex, "fork-1")  # the fork answers first
    r.record_output(
        ex,
        "f1",
        fork.gen_prompt,
        np.asarray([*spelled, 2]),
        [],
        "",
        "All done.",
        agent="fork-1",
        context=fork.context,
        position=2,
    )
    main, _ = r.render(main_conv, ex, "main")
    r.record_output(
        ex,
        "m1",
        main.gen_prompt,
        np.asarray([*done, 2]),
        [],
        "",
        "All done.",
        agent="main",
        context=main.context,
        position=1,
    )
    later = (*main_conv.turns, Turn(Kind.ASSISTANT, "All done."), Turn(Kind.USER, "again"))
    for agent in ("main", "fork-1"):  # exact context first: whoever asks, the turn is the main loop's
        again, _ = r.render(Conversation("sys", (), later), ex, agent)
        assert again.ambiguous == 0
        assert " ".join(map(str, [*done, 2])) in " ".join(map(str, again.ids().tolist()))
    # the system prompt changed since (no exact context): the agent's own output
    moved, _ = r.render(Conversation("new sys", (), later), ex, "main")
    assert moved.ambiguous == 0 and " ".join(map(str, [*done, 2])) in " ".join(map(str, moved.ids().tolist()))
    # a retry of the main call in the same conversation sampled other ids: ambiguous
    r.record_output(
        ex,
        "m2",
        main.gen_prompt,
        np.asarray([*spelled, 2]),
        [],
        "",
        "All done.",
        agent="main",
        context=main.context,
        position=1,
    )
    ex.agents.clear()  # no render cache to reuse: the turn is looked up again
    unsure, _ = r.render(Conversation("sys", (), later), ex, "main")
    assert unsure.ambiguous == 1 and unsure.recorded_tokens == 0
