"""The built-in harness: a tool-using agent that talks to the policy over the Anthropic Messages API.

One execution is a loop of model calls to gyre-proxy's `/e/{execution}/v1/messages` with the built-in
tools, at most `turns` of them. When the model emits `tool_use` blocks the harness runs those tools and
answers with `tool_result`s; when it answers without one, the execution ends with that answer. With
`scripted_fallback` (for a random model, which rarely emits a well-formed call) a turn without a tool
call instead runs the task's next scripted tool itself and passes the output on as a user turn, as
before. Every turn records where its tool call came from (`model`, `script`, or `missed`: the model
answered while the task still needed a tool and no fallback ran), so the share of the needed tool calls
that the model made itself can be reported. Tool time is a sleep before each call, so an execution's
length follows the configured profile; the `Execution` record keeps the progress, so a run cut by the
driver's timeout can still be scored. Overloaded answers (529/503: no engine while the pool trains) are
retried, and so are server errors (5xx: e.g. a proxy whose record log cannot be written) and a call the
proxy never answered (connection refused or dropped: a proxy being restarted), as real harnesses (the
Anthropic SDK's retry rule) do.
"""

from __future__ import annotations

import asyncio
import enum
import json
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from gyre.rollout.tasks.qa import TOOL_LINE, Task, ToolCall, run_tool

RETRYABLE = (409, 429, 503, 529)


SYSTEM = f"Tools: {TOOL_LINE}. Call one as <tool_call>, then answer with the value only."
"""The harness's system prompt: its tools in one line. It sends no `tools` field: the Qwen template's
tools block is 400 tokens of JSON schema in front of every question, which a model of a million
parameters must learn to look past (its warm start did not, in 480 steps); the calls it makes are the
same `<tool_call>` JSON the proxy parses into `tool_use` blocks either way."""


class HarnessError(RuntimeError):
    """The proxy refused a call in a way a retry cannot fix."""


class ToolSource(enum.StrEnum):
    MODEL = "model"
    """The model's own tool_use block, parsed by the proxy and run by the harness."""
    SCRIPT = "script"
    """The scripted fallback ran the task's next tool (the model made no call)."""
    MISSED = "missed"
    """The model answered without the tool call the task still needed; no fallback ran."""
    NONE = "none"
    """No tool call and none needed (the final answer)."""


@dataclass(frozen=True)
class TurnLog:
    source: ToolSource
    tools: tuple[tuple[str, str, str], ...] = ()
    """(name, arguments as JSON, output) of each tool run after this turn."""


@dataclass
class Execution:
    execution_id: str
    group_id: str
    task: Task
    tool_s: float
    """Total tool time (seconds), spread evenly before the calls."""
    calls: int = 0
    """Model calls that completed (each one is a TITO record at the proxy)."""
    final_text: str | None = None
    """Text of the latest assistant turn; None until one call completed."""
    retries: int = 0
    messages: list[dict[str, Any]] = field(default_factory=list)
    turns: list[TurnLog] = field(default_factory=list)

    def model_calls(self) -> list[ToolCall]:
        """The tool calls the model made itself, in order: (name, arguments), what the unit tests read."""
        return [(n, json.loads(a)) for t in self.turns if t.source is ToolSource.MODEL for n, a, _ in t.tools]

    def tool_calls(self) -> dict[str, int]:
        """Tool calls the task needed, by who made them (model / script / missed)."""
        out = {s.value: 0 for s in (ToolSource.MODEL, ToolSource.SCRIPT, ToolSource.MISSED)}
        for t in self.turns:
            if t.source is not ToolSource.NONE:
                out[t.source.value] += 1
        return out


class Retrying(Protocol):
    """What `call_proxy` reads and counts of an execution."""

    execution_id: str
    retries: int


async def call_proxy(
    http: httpx.AsyncClient, url: str, body: dict[str, Any], ex: Retrying, retry_until: float
) -> dict[str, Any]:
    """POST `body` to the proxy and return its JSON answer, retrying (counted in `ex.retries`) what a real
    harness retries (module docstring) until `retry_until` (the loop's clock); `HarnessError` otherwise."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            r = await http.post(url, json=body)
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
            if loop.time() >= retry_until:
                raise
            ex.retries += 1
            await asyncio.sleep(0.25)
            continue
        if r.status_code == 200:
            out: dict[str, Any] = r.json()
            return out
        if (r.status_code in RETRYABLE or r.status_code >= 500) and loop.time() < retry_until:
            ex.retries += 1
            await asyncio.sleep(0.25)
            continue
        raise HarnessError(f"{ex.execution_id}: proxy answered {r.status_code}: {r.text[:300]}")


def request_body(messages: list[dict[str, Any]], max_tokens: int, temperature: float) -> dict[str, Any]:
    """The Anthropic Messages request the harness sends (the warm start renders the same bodies)."""
    return {
        "model": "gyre-policy",
        "max_tokens": max_tokens,
        "temperature": temperature,
        "system": SYSTEM,
        "messages": messages,
    }


def run_tools(
    task: Task, uses: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[tuple[str, str, str]]]:
    """The model's `tool_use` blocks run on the task's state: tool_result blocks, and (name, arguments,
    output) of each call."""
    results, ran = [], []
    for u in uses:
        given = u.get("input")
        args: dict[str, Any] = given if isinstance(given, dict) else {}
        out, err = run_tool(task, str(u.get("name", "")), args)
        ran.append((str(u.get("name", "")), json.dumps(args), out))
        results.append({"type": "tool_result", "tool_use_id": u["id"], "content": out, "is_error": err})
    return results, ran


async def run_execution(
    http: httpx.AsyncClient,
    proxy_url: str,
    ex: Execution,
    *,
    turns: int,
    max_tokens: int,
    temperature: float,
    retry_for_s: float,
    scripted_fallback: bool = False,
) -> Execution:
    """Run one execution to its end (the caller applies the hard timeout by cancelling)."""
    url = f"{proxy_url}/e/{ex.execution_id}/v1/messages"
    loop = asyncio.get_running_loop()
    script = list(ex.task.script)
    ex.messages = [{"role": "user", "content": ex.task.prompt}]
    for turn in range(turns):
        await asyncio.sleep(ex.tool_s / turns)
        body = request_body(ex.messages, max_tokens, temperature)
        resp = await call_proxy(http, url, body, ex, loop.time() + retry_for_s)
        ex.calls += 1
        content = resp.get("content") or []
        ex.final_text = "".join(b.get("text", "") for b in content if b.get("type") == "text")
        uses = [b for b in content if b.get("type") == "tool_use"]
        if turn == turns - 1:
            ex.turns.append(TurnLog(ToolSource.MODEL if uses else _missed(script)))
            break
        ex.messages.append({"role": "assistant", "content": content or [{"type": "text", "text": ""}]})
        if uses:
            results, ran = run_tools(ex.task, uses)
            del script[: len(uses)]
            ex.turns.append(TurnLog(ToolSource.MODEL, tuple(ran)))
            ex.messages.append({"role": "user", "content": results})
        elif scripted_fallback and script:
            step = script.pop(0)
            out, _ = run_tool(ex.task, step.name, step.arguments)
            call = json.dumps(step.arguments)
            ex.turns.append(TurnLog(ToolSource.SCRIPT, ((step.name, call, out),)))
            ex.messages.append({"role": "user", "content": f"[{step.name}({call})] -> {out}"})
        elif scripted_fallback:
            ex.turns.append(TurnLog(ToolSource.NONE))
            ex.messages.append({"role": "user", "content": "Give the final answer now."})
        else:  # the model answered: the execution ends here
            ex.turns.append(TurnLog(_missed(script)))
            break
    return ex


def _missed(script: list[Any]) -> ToolSource:
    return ToolSource.MISSED if script else ToolSource.NONE
