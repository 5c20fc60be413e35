"""Decoding an Anthropic request from where an earlier request's messages end (`decode_conversation` with
`earlier`): the result, or the error, is exactly the plain decode's, whatever the harness changed between
calls (appended messages, edited earlier ones, keys in another order, other whitespace, a `/compact`
rewrite, other fields after the messages, bytes that are not JSON), and an appended call decodes only
its new messages, and the proxy keeps the large bodies of each execution for that."""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
import pytest
from gyre_proxy import anthropic_request as AR
from gyre_proxy.bodycache import BodyCache
from gyre_proxy.chat import RequestError
from gyre_proxy.core import KEPT_BODY_BYTES
from gyre_proxy.msgcache import MessageCache
from gyre_proxy.strip import Stripper
from hypothesis import given, settings
from hypothesis import strategies as st

STRIP = Stripper(())
TOOLS = [{"name": "bash", "description": "run", "input_schema": {"type": "object"}}]


def plain(body: bytes) -> tuple[Any, ...]:
    try:
        req = AR.decode(body)
    except RequestError as e:
        return ("refused", e.field, str(e))
    assert isinstance(req, AR.ARequest)
    return ("ok", req, AR.to_conversation(req, STRIP))


class Session:
    """Requests decoded as the proxy decodes them: through the message cache and the kept bodies."""

    def __init__(self, per_execution: int = 4) -> None:
        self.cache = MessageCache(1 << 24)
        self.bodies: BodyCache[AR.Decoded] = BodyCache(1 << 26, per_execution)
        self.appended = 0

    def decode(self, body: bytes) -> tuple[Any, ...]:
        looked = self.cache.hits + self.cache.misses
        try:
            req, conv, dec = AR.decode_conversation(body, STRIP, self.cache, self.bodies.get("ex"))
        except RequestError as e:
            return ("refused", e.field, str(e))
        if dec is not None:
            self.bodies.put("ex", len(body), dec)
        if self.cache.hits + self.cache.misses - looked < len(req.messages):
            self.appended += 1  # some messages were taken from an earlier request, not looked up
        return ("ok", req, conv)


# ------------------------------------------------------------------------------------ conversations


def _text(rng: random.Random) -> str:
    return rng.choice(["", "ok", "ls -la", "naïve ✓", 'quote " and \\ slash', "x" * rng.randint(1, 40)])


def _message(rng: random.Random, role: str, asked: list[str], k: int, bad: float) -> dict[str, Any]:
    """A message of `role` answering `asked` (the previous assistant's tool ids); now and then a wrong one."""
    if role == "system":
        return {"role": "system", "content": rng.choice([[], "", _text(rng)])}
    if role == "user":
        blocks: list[dict[str, Any]] = [
            {"type": "tool_result", "tool_use_id": t, "content": _text(rng) or "done"} for t in asked
        ]
        if not blocks or rng.random() < 0.3:
            blocks.append({"type": "text", "text": _text(rng) or "go"})
        if rng.random() < bad:
            blocks.append(rng.choice([{"type": "pictogram"}, {"type": "tool_result", "tool_use_id": "nope"}]))
        if rng.random() < bad and blocks:
            blocks.pop(0)  # a tool_use left unanswered
        if not asked and rng.random() < 0.3:
            return {"role": "user", "content": _text(rng) or "hi"}
        return {"role": "user", "content": blocks}
    content: list[dict[str, Any]] = []
    if rng.random() < 0.3:
        content.append({"type": "thinking", "thinking": _text(rng), "signature": f"s{k}"})
    if rng.random() < 0.7:
        content.append({"type": "text", "text": _text(rng)})
    for j in range(rng.choice([0, 0, 1, 2])):
        content.append({"type": "tool_use", "id": f"t{k}_{j}", "name": "bash", "input": {"c": _text(rng)}})
    if rng.random() < bad:
        content.append({"type": "tool_use", "id": f"u{k}", "name": "bash", "input": rng.choice([[1], "s"])})
    return {"role": "assistant", "content": content}


def _conversation(rng: random.Random, n: int, bad: float) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    role = "user"
    asked: list[str] = []
    for k in range(n):
        if rng.random() < 0.08:
            msgs.append(_message(rng, "system", [], k, bad))
            continue
        if rng.random() < bad / 2:
            role = rng.choice(["user", "assistant", "tool"])
        m = _message(rng, role if role != "tool" else "user", asked, k, bad)
        m["role"] = role
        msgs.append(m)
        content = m["content"]
        asked = (
            [b["id"] for b in content if b.get("type") == "tool_use"]
            if role == "assistant" and isinstance(content, list)
            else []
        )
        role = "assistant" if role == "user" else "user"
    return msgs


def _body(
    rng: random.Random, msgs: list[dict[str, Any]], order: list[str], style: int, extra: dict[str, Any]
) -> bytes:
    fields = {"model": "m", "max_tokens": 64, "system": "be brief", "tools": TOOLS, "messages": msgs, **extra}
    ordered = {k: fields[k] for k in order if k in fields} | fields
    if style == 0:
        return json.dumps(ordered, separators=(",", ":"), ensure_ascii=False).encode()
    if style == 1:
        return json.dumps(ordered).encode()
    return json.dumps(ordered, indent=1).encode()


@settings(max_examples=400, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_appended_decode_is_the_plain_decode(seed: int) -> None:
    rng = random.Random(seed)
    bad = rng.choice([0.0, 0.0, 0.05, 0.2])
    convo = _conversation(rng, rng.randint(2, 30), bad)
    keys = ["model", "max_tokens", "system", "tools", "messages"]
    order = rng.sample(keys, len(keys))
    style = rng.choice([0, 0, 0, 1, 2])
    extra: dict[str, Any] = {}
    n = rng.randint(1, len(convo))
    s = Session(per_execution=rng.choice([1, 4]))
    sent: list[bytes] = []
    last: tuple[Any, ...] | None = None  # the last call decoded whole or appended, as it was made
    for _ in range(rng.randint(2, 8)):
        msgs = convo[:n]
        body = _body(rng, msgs, order, style, extra)
        action = rng.random()
        if action < 0.05:  # bytes that are not quite the JSON of a request
            body = rng.choice(
                [
                    body.replace(b"}]", b"},]", 1),
                    body.rstrip(b"}") + b',"messages":[]}',
                    body.rstrip(b"}") + b',"messages":[{"role":"user","content":"x"}]}',
                    body[: rng.randint(1, len(body))],
                    body.replace(b'"role"', b' "role"', 1),
                ]
            )
        elif action < 0.1 and sent:
            body = rng.choice(sent)  # sent again as it was
        before = s.appended
        want = plain(body)
        assert s.decode(body) == want
        now = (msgs, order, style, extra)
        if action >= 0.1 and last is not None and want[0] == "ok":
            extends = last[0] == msgs[: len(last[0])] and last[1:] == now[1:]
            # an extension is decoded from where the last call's messages ended (another call may match too)
            assert s.appended == before + 1 or not extends
        last = (list(msgs), order, style, dict(extra)) if want[0] == "ok" and action >= 0.1 else None
        sent.append(body)
        step = rng.random()
        if step < 0.55:
            n = min(len(convo), n + rng.randint(0, 3))
        elif step < 0.65 and n > 1:  # an earlier message edited
            i = rng.randrange(n)
            convo[i] = {**convo[i], "content": _text(rng) or "edited"}
        elif step < 0.7:
            order = rng.sample(keys, len(keys))
        elif step < 0.75:
            style = rng.choice([0, 1, 2])
        elif step < 0.82:  # /compact: the history replaced by a summary
            convo = [
                {"role": "system", "content": []},
                {"role": "user", "content": "summary"},
                *_conversation(rng, rng.randint(1, 10), bad),
            ]
            n = 2
        elif step < 0.9:
            extra = rng.choice(
                [
                    {},
                    {"max_tokens": rng.choice([0, 5])},
                    {"system": [{"type": "text", "text": "s"}]},
                    {"stream": True},
                    {"system": [{"type": "image"}]},
                    {"temperature": 0.5},
                ]
            )
        elif n > 1:
            n -= 1  # a message dropped from the end


def _calls(msgs: list[dict[str, Any]]) -> list[bytes]:
    return [
        json.dumps({"model": "m", "max_tokens": 8, "messages": msgs[:n], "system": "s"}).encode()
        for n in range(1, len(msgs) + 1)
    ]


def _valid() -> list[dict[str, Any]]:
    tool = {"type": "tool_use", "id": "t1", "name": "bash", "input": {"command": "ls"}}
    return [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}, tool]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a.txt"}]},
        {"role": "system", "content": []},
        {"role": "assistant", "content": [{"type": "text", "text": "done"}]},
        {"role": "user", "content": "thanks"},
    ]


def test_an_appended_call_decodes_only_its_new_messages() -> None:
    s = Session()
    for body in _calls(_valid()):
        looked = s.cache.hits + s.cache.misses
        assert s.decode(body) == plain(body)
        assert s.cache.hits + s.cache.misses - looked == 1  # one new message each call
    assert s.appended == 5


@pytest.mark.parametrize(
    ("new", "field"),
    [
        ([{"role": "user", "content": [{"type": "pictogram"}]}], "messages.6.content.0.type"),
        (
            [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t9", "content": "x"}]}],
            "messages.6.content.0",
        ),
        (
            [
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t2", "name": "b", "input": {}}],
                },
                {"role": "user", "content": "no answer"},
            ],
            "messages.6",
        ),
        ([{"role": "tool", "content": "x"}], "messages.6.role"),
        ([{"role": "user", "content": []}], "messages.6"),
        ([{"role": "user", "content": 5}], "messages[6].content"),
    ],
)
def test_invalid_new_messages_are_refused_as_before(new: list[dict[str, Any]], field: str) -> None:
    s = Session()
    for body in _calls(_valid()):
        s.decode(body)
    body = _calls([*_valid(), *new])[-1]
    got = s.decode(body)
    assert got == plain(body) and got[:2] == ("refused", field)


def test_an_empty_final_reply_then_followed_is_refused() -> None:
    """The earlier request's final assistant message may be empty; once another follows it, it may not."""
    s = Session()
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "go"}, {"role": "assistant", "content": []}]
    first, later = _calls([*msgs, {"role": "user", "content": "again"}])[1:]
    assert s.decode(first)[0] == "ok"
    got = s.decode(later)
    assert got == plain(later) and got[:2] == ("refused", "messages.1")


def test_bytes_after_the_messages_that_are_not_json_are_refused_as_before() -> None:
    s = Session()
    msgs = _valid()[:3]
    base = json.dumps({"model": "m", "max_tokens": 8, "messages": msgs}).encode()
    assert s.decode(base)[0] == "ok"
    for body in [
        base[:-2] + b",]}",  # a trailing comma
        base[:-2] + b'],"messages":[]}',  # a later `messages` key wins
        base[:-2] + b"]\x0c}",  # not JSON whitespace
        base[:-2] + b', {"role":"user","content":"x"}],"max_tokens":0}',
    ]:
        assert s.decode(body) == plain(body)
        assert s.decode(body)[0] == "refused"


def test_kept_bodies_are_bounded() -> None:
    """At most `per_execution` per execution, newest first; past `max_bytes` the least recently used
    execution's oldest go first; a body over the bound is not kept."""
    kept: BodyCache[str] = BodyCache(max_bytes=100, per_execution=2)
    for v in ("a1", "a2", "a3"):
        kept.put("a", 30, v)
    assert kept.get("a") == ["a3", "a2"] and kept.bytes == 60
    kept.put("b", 30, "b1")
    assert kept.get("a") == ["a3", "a2"]  # `a` is now the most recently used
    kept.put("c", 30, "c1")  # 120 bytes: `b`, the least recently used, goes
    assert kept.get("b") == [] and kept.get("c") == ["c1"] and kept.bytes == 90
    kept.put("d", 101, "too big")
    assert kept.get("d") == [] and len(kept) == 3


def test_the_proxy_decodes_a_large_appended_call_from_where_the_last_ended(
    engine: Any, make_proxy: Any
) -> None:
    """Over HTTP: a request over `KEPT_BODY_BYTES` is kept; the next call of its execution that resends its
    messages looks up only its new ones; a small request is not kept."""
    ps = make_proxy([engine.url])
    proxy = ps.proxy
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "word " * (KEPT_BODY_BYTES // 4)}]
    head = {"x-gyre-execution": "big"}
    r = httpx.post(
        f"{ps.url}/v1/messages", json={"model": "m", "max_tokens": 3, "messages": msgs}, headers=head
    )
    assert r.status_code == 200, r.text
    assert len(proxy.bodies) == 1
    msgs += [{"role": "assistant", "content": r.json()["content"]}, {"role": "user", "content": "and then?"}]
    looked = proxy.messages.hits + proxy.messages.misses
    r = httpx.post(
        f"{ps.url}/v1/messages", json={"model": "m", "max_tokens": 3, "messages": msgs}, headers=head
    )
    assert r.status_code == 200, r.text
    assert proxy.messages.hits + proxy.messages.misses - looked == 2 and len(proxy.bodies) == 2
    small = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    assert (
        httpx.post(f"{ps.url}/v1/messages", json=small, headers={"x-gyre-execution": "small"}).status_code
        == 200
    )
    assert len(proxy.bodies) == 2
