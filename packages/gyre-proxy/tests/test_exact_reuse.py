"""Every output shape the proxy produces, sent back by the official `anthropic` and `openai` SDKs as a
client sends it, is reused exactly: each call's input starts with the previous call's exact input and
output (no re-rendered assistant turn), the proxy counts 0 non-extensions and gyre-traj finds 0 drift
and 0 non-extensions in the log. Shapes: text; text, a tool call, text; text, a malformed tool call,
text; text then a tool call cut by max_tokens; an empty output; thinking only; whitespace only. Thinking
is off, so the
prompt opens each reply with an empty think block: a re-rendered turn would diverge there, at a context
token (a branch, not drift), which only the non-extension count sees."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import numpy as np
import openai
from gyre_traj.io import read_records
from gyre_traj.records import Call
from gyre_traj.summary import summarize
from gyre_traj.tree import Forest
from tokenizers import Tokenizer

BASH = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
TEXT = "Hello there."
TOOL = f"Checking.\n{BASH}\nAnd more."
MALFORMED = 'Trying.\n<tool_call>\n{"name": "bash", "arguments": {"command": \n</tool_call>\nThat was wrong.'
CUT_FULL = 'Next:\n<tool_call>\n{"name": "bash", "arguments": {"command": "cat a.txt"}}\n</tool_call>'
THINKING = "<think>\nPondering.\n</think>\n\n"
ANTHROPIC_TOOLS: list[Any] = [
    {"name": "bash", "description": "Run", "input_schema": {"type": "object", "properties": {}}}
]
OPENAI_TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "bash", "description": "Run", "parameters": {"type": "object"}}}
]


def _script(tokenizer: Tokenizer) -> tuple[list[Any], int, str]:
    """The engine's outputs, the max_tokens that cuts CUT_FULL inside its tool call, and the cut text."""
    cut_ids = tokenizer.encode(CUT_FULL, add_special_tokens=False).ids[:-6]
    empty = [tokenizer.token_to_id("<|im_end|>")]
    cut = tokenizer.decode(cut_ids, skip_special_tokens=False)
    return [TEXT, TOOL, MALFORMED, CUT_FULL, empty, THINKING, " \n\n", "Done."], len(cut_ids), cut


def _check_extends(ps: Any, engine: Any, n: int) -> None:
    recs = [r for r in read_records(ps.log_path) if isinstance(r, Call)]
    assert len(recs) == n and len(engine.seen) == n
    seq: dict[str, np.ndarray] = {}
    for i, r in enumerate(recs):
        d = r.input_delta
        inp = r.input_ids if d is None else np.concatenate([seq[d.parent][: d.keep], d.append])
        assert inp is not None and inp.tolist() == engine.seen[i].input_ids
        assert r.output_ids.tolist() == engine.outputs[i]
        if i:
            prev = seq[recs[i - 1].call_id].tolist()
            assert inp.tolist()[: len(prev)] == prev, f"call {i} does not extend call {i - 1}"
            assert r.metadata["extends"] == recs[i - 1].call_id
        seq[r.call_id] = np.concatenate([inp, r.output_ids])
    stats = httpx.get(f"{ps.url}/gyre/stats").json()
    assert (stats["appended_calls"], stats["non_extensions"], stats["ambiguous_turns"]) == (n - 1, 0, 0)
    (tree,) = Forest().add_msgpack(ps.log_path.read_bytes())
    extends = {r.call_id: r.metadata["extends"] for r in recs[1:]}
    s = summarize(tree, extends=extends)
    assert (s.drifts, s.appended_calls, s.non_extensions) == (0, n - 1, 0)


def test_anthropic_client_sends_every_shape_back(
    engine: Any, make_proxy: Any, tokenizer: Tokenizer, request: Any
) -> None:
    script, cut_at, cut_text = _script(tokenizer)
    engine.script = list(script)
    ps = make_proxy([engine.url])
    client = anthropic.Anthropic(base_url=f"{ps.url}/e/a-1", api_key="k", max_retries=0)
    request.addfinalizer(client.close)
    msgs: list[Any] = [{"role": "user", "content": "Start."}]
    got: list[list[Any]] = []
    for k in range(len(script)):
        kw: dict[str, Any] = {"model": "m", "tools": ANTHROPIC_TOOLS, "messages": msgs}
        kw["max_tokens"] = cut_at if k == 3 else 200
        if k % 2:
            with client.messages.stream(**kw) as st:
                r = st.get_final_message()
        else:
            r = client.messages.create(**kw)
        content = [b.model_dump(exclude_none=True) for b in r.content]
        got.append(content)
        if content:
            msgs = [*msgs, {"role": "assistant", "content": content}]
        elif k == 6:  # a blank reply sent back as an empty text block (gyre's built-in agent does this)
            msgs = [*msgs, {"role": "assistant", "content": [{"type": "text", "text": ""}]}]
        # else: Anthropic's API refuses an empty assistant message, so a client leaves the turn out
        uses = [b for b in content if b["type"] == "tool_use"]
        answer = [{"type": "tool_result", "tool_use_id": u["id"], "content": "a.txt"} for u in uses]
        msgs = [*msgs, {"role": "user", "content": answer or f"Turn {k}."}]
    assert [b["text"] for b in got[2]] == [MALFORMED]  # as the model wrote it, in one text block
    assert [b["text"] for b in got[3]] == [cut_text]
    assert [b["type"] for b in got[1]] == ["text", "tool_use", "text"]
    assert got[4] == got[6] == [] and [b["type"] for b in got[5]] == ["thinking"]
    _check_extends(ps, engine, len(script))
    assert httpx.get(f"{ps.url}/gyre/stats").json()["restored_empty_replies"] == 1


def _streamed_message(stream: Any) -> dict[str, Any]:
    """The assistant message a client assembles from the chunks."""
    msg: dict[str, Any] = {"role": "assistant", "content": ""}
    calls: dict[int, dict[str, Any]] = {}
    for chunk in stream:
        for ch in chunk.choices:
            d = ch.delta
            msg["content"] += d.content or ""
            extra = d.model_extra or {}
            if extra.get("reasoning_content"):
                msg["reasoning_content"] = msg.get("reasoning_content", "") + extra["reasoning_content"]
            for tc in d.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": "", "type": "function", "function": {}})
                slot["id"] += tc.id or ""
                fn = slot["function"]
                fn["name"] = fn.get("name", "") + (tc.function.name or "" if tc.function else "")
                fn["arguments"] = fn.get("arguments", "") + (
                    tc.function.arguments or "" if tc.function else ""
                )
    if calls:
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return msg


def test_openai_client_sends_every_shape_back(
    engine: Any, make_proxy: Any, tokenizer: Tokenizer, request: Any
) -> None:
    script, cut_at, cut_text = _script(tokenizer)
    engine.script = list(script)
    ps = make_proxy([engine.url])
    client = openai.OpenAI(base_url=f"{ps.url}/e/o-1/v1", api_key="k", max_retries=0)
    request.addfinalizer(client.close)
    msgs: list[Any] = [{"role": "user", "content": "Start."}]
    got: list[Any] = []
    for k in range(len(script)):
        kw: dict[str, Any] = {"model": "m", "tools": OPENAI_TOOLS, "messages": msgs}
        kw["max_tokens"] = cut_at if k == 3 else 200
        if k % 2:
            sent = _streamed_message(client.chat.completions.create(**kw, stream=True))
        else:
            sent = client.chat.completions.create(**kw).choices[0].message.model_dump(exclude_none=True)
        got.append(sent)
        msgs = [*msgs, sent]
        for c in sent.get("tool_calls", []):
            msgs = [*msgs, {"role": "tool", "tool_call_id": c["id"], "content": "a.txt"}]
        if not sent.get("tool_calls"):
            msgs = [*msgs, {"role": "user", "content": f"Turn {k}."}]
    assert got[0]["content"] == TEXT
    assert got[1]["content"] == "Checking.\nAnd more." and len(got[1]["tool_calls"]) == 1
    assert got[2]["content"] == MALFORMED and got[3]["content"] == cut_text
    assert got[4]["content"] == "" and got[6]["content"] == ""
    assert got[5]["content"] == "" and got[5]["reasoning_content"] == "Pondering."
    _check_extends(ps, engine, len(script))


def test_openai_sampling_fields_and_logprobs(engine: Any, make_proxy: Any, request: Any) -> None:
    """seed, penalties and logit_bias reach the engine as SGLang's sampling_params; logprobs are the
    recorded ones, one entry per sampled token."""
    engine.script = ["Fine.", "Again."]
    ps = make_proxy([engine.url])
    client = openai.OpenAI(base_url=f"{ps.url}/v1", api_key="k", max_retries=0)
    request.addfinalizer(client.close)
    msgs: list[Any] = [{"role": "user", "content": "Go."}]
    r = client.chat.completions.create(
        model="m",
        messages=msgs,
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        logit_bias={"5": 10},
        logprobs=True,
        max_completion_tokens=30,
    )
    sp = engine.seen[0].sampling_params
    assert (sp["sampling_seed"], sp["presence_penalty"], sp["frequency_penalty"]) == (7, 0.5, 0.25)
    assert sp["logit_bias"] == {"5": 10.0} and sp["max_new_tokens"] == 30
    lp = r.choices[0].logprobs
    assert lp is not None and lp.content is not None
    out = engine.outputs[0]
    assert [e.logprob for e in lp.content] == [engine.logprob(i, t) for i, t in enumerate(out)]
    assert "".join(e.token for e in lp.content) == "Fine.<|im_end|>"
    entries = []
    for chunk in client.chat.completions.create(model="m", messages=msgs, logprobs=True, stream=True):
        for ch in chunk.choices:
            entries += ch.logprobs.content or [] if ch.logprobs else []
    assert [e.logprob for e in entries] == [engine.logprob(i, t) for i, t in enumerate(engine.outputs[1])]


def _spelled(tokenizer: Tokenizer, text: str) -> list[int]:
    """`text` one token per character, then the end token: the same text as other ids."""
    ids = [i for ch in text for i in tokenizer.encode(ch, add_special_tokens=False).ids]
    return [*ids, tokenizer.token_to_id("<|im_end|>")]


def test_harness_given_agent_ids_settle_which_output_a_turn_is(
    engine: Any, make_proxy: Any, tokenizer: Tokenizer
) -> None:
    """Two agents named by `X-Gyre-Agent` in one execution, with the same system prompt and first user
    turn, answer the same text as different ids and continue: each next input extends its own agent's
    call (0 non-extensions, nothing ambiguous). A retry inside one agent that sampled other ids is a real
    ambiguity: counted once in `ambiguous_turns` and once in `non_extensions`, however often the agent
    continues after it."""
    im_end = tokenizer.token_to_id("<|im_end|>")
    own = [*tokenizer.encode("Same answer.", add_special_tokens=False).ids, im_end]
    engine.script = [own, _spelled(tokenizer, "Same answer."), "a", "b"]
    ps = make_proxy([engine.url])
    first = [{"role": "user", "content": "task"}]

    def call(agent: str, messages: list[dict[str, Any]]) -> str:
        body = {"model": "m", "max_tokens": 50, "system": "sys", "messages": messages}
        r = httpx.post(f"{ps.url}/v1/messages", json=body, headers={"x-gyre-agent": agent})
        assert r.status_code == 200, r.text
        return "".join(b["text"] for b in r.json()["content"])

    def stats() -> tuple[int, int, int]:
        s = httpx.get(f"{ps.url}/gyre/stats").json()
        return s["appended_calls"], s["non_extensions"], s["ambiguous_turns"]

    texts = {a: call(a, first) for a in ("a1", "a2")}
    assert texts == {"a1": "Same answer.", "a2": "Same answer."}
    for a in ("a1", "a2"):
        call(a, [*first, {"role": "assistant", "content": texts[a]}, {"role": "user", "content": "next"}])
    outs = dict(zip(("a1", "a2"), engine.outputs[:2], strict=True))
    for i, a in ((2, "a1"), (3, "a2")):
        prefix = [*engine.seen[i - 2].input_ids, *outs[a]]
        assert engine.seen[i].input_ids[: len(prefix)] == prefix, f"{a}'s call does not extend its own"
    assert stats() == (2, 0, 0)

    # a retry inside one agent: the same conversation answered twice, as other ids
    engine.script = [own, _spelled(tokenizer, "Same answer."), "c", "d"]
    other = [{"role": "user", "content": "other task"}]
    call("r", other)
    call("r", other)
    convo = [*other, {"role": "assistant", "content": "Same answer."}, {"role": "user", "content": "next"}]
    call("r", convo)
    assert stats() == (3, 1, 1)
    call("r", [*convo, {"role": "assistant", "content": "c"}, {"role": "user", "content": "more"}])
    assert stats() == (4, 1, 1)
