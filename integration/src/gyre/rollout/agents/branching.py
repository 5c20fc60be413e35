"""The built-in agent whose trees branch: compaction, sub-agents and retries of failed calls.

The same tool loop as `agent.run_execution` (the same tools, system prompt, scripted fallback and
`Execution` record), with three things a long-running harness does, each of which leaves a branch in
the execution's tree at the proxy:

- **Compaction** (`compact_tokens`): once a main call's context (the proxy's `usage`: input, cached
  input included, plus output tokens) passes the threshold, the agent asks for a summary with Claude
  Code's compaction request ("Your task is to create a detailed summary of the conversation so far",
  which gyre-proxy's classifier marks `main_summary`) and restarts its conversation from the question
  and that summary.
- **Sub-agents** (`subagents`): each tool step (the model's tool call, or the scripted fallback's) is
  delegated to a sub-agent, a conversation of its own sent with `X-Gyre-Agent: sub-N` (role `subagent`
  at the proxy): asked to make the call, it makes it (or the fallback runs it), sees the result and
  answers; the tool's output it obtained goes back to the main agent as the step's result.
- **Retries** (`call_retries`): a reply cut at `max_tokens`, or holding a `<tool_call>` the proxy could
  not parse, is sent again unchanged, up to `call_retries` times; the failed reply stays in the tree as a
  dead branch (a leaf of role main like the rest: J_max selection ranks it by its tie-breaks).

Overloaded answers (409/429/503/529) are retried as in `agent.py` (no record is made for them). A call
in flight when the driver's timeout cancels the execution is waited for and counted (the proxy records
it either way), so the trajectory service expects every record the execution leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import httpx

from gyre.rollout.agents.agent import (
    RETRYABLE,
    Execution,
    HarnessError,
    ToolSource,
    TurnLog,
    request_body,
    run_tools,
)
from gyre.rollout.tasks.qa import run_tool

COMPACT_PROMPT = (
    "Your task is to create a detailed summary of the conversation so far: the question, the tools "
    "called with their results, and what is left to do."
)
"""The compaction request (its opening is Claude Code's, which gyre-proxy classifies as a summary)."""
SUB_TURNS = 2
"""Calls of one sub-agent: the call it is asked to make, then its answer on the result."""


@dataclass(frozen=True)
class Branching:
    compact_tokens: int = 0
    """Compact once a main call's context passes this many tokens; 0: never."""
    subagents: bool = False
    call_retries: int = 0


@dataclass
class _Caller:
    http: httpx.AsyncClient
    url: str
    ex: Execution
    policy: Branching
    max_tokens: int
    temperature: float
    retry_for_s: float
    subs: int = 0

    async def post(self, messages: list[dict[str, Any]], agent: str) -> dict[str, Any]:
        """One model call (overloaded answers retried until `retry_for_s`); counts the completed call."""
        body = request_body(messages, self.max_tokens, self.temperature)
        headers = {"X-Gyre-Agent": agent} if agent else {}
        until = asyncio.get_running_loop().time() + self.retry_for_s
        while True:
            r = await self._finish(self.http.post(self.url, json=body, headers=headers))
            if r.status_code == 200:
                self.ex.calls += 1
                out: dict[str, Any] = r.json()
                return out
            if r.status_code in RETRYABLE and asyncio.get_running_loop().time() < until:
                self.ex.retries += 1
                await asyncio.sleep(0.25)
                continue
            raise HarnessError(f"{self.ex.execution_id}: proxy answered {r.status_code}: {r.text[:300]}")

    async def _finish(self, request: Coroutine[Any, Any, httpx.Response]) -> httpx.Response:
        """The call's response. Cancelled (the driver's timeout) while the call is at the proxy, which
        completes and records it anyway, it waits for that response and counts the call before ending:
        so every record of the execution is one the driver expects (none arrives after its group)."""
        call = asyncio.ensure_future(request)
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            with contextlib.suppress(httpx.HTTPError, asyncio.CancelledError):
                if (await call).status_code == 200:
                    self.ex.calls += 1
            raise

    async def ask(self, messages: list[dict[str, Any]], agent: str = "") -> dict[str, Any]:
        """A call, sent again unchanged while its reply failed (cut, or an unparsed tool call)."""
        for _ in range(self.policy.call_retries):
            resp = await self.post(messages, agent)
            if not failed(resp):
                return resp
        return await self.post(messages, agent)

    async def delegate(self, name: str, args: dict[str, Any]) -> tuple[str, bool]:
        """Run one tool step through a new sub-agent; (the tool's output, is_error)."""
        self.subs += 1
        agent = f"sub-{self.subs}"
        msgs: list[dict[str, Any]] = [
            {"role": "user", "content": f"Call {name} with {json.dumps(args)} and report its output."}
        ]
        resp = await self.ask(msgs, agent)
        content = resp.get("content") or []
        uses = [b for b in content if b.get("type") == "tool_use"]
        msgs.append({"role": "assistant", "content": content or [{"type": "text", "text": ""}]})
        if uses:  # the sub-agent's own call(s): run them; the first one's output is the step's result
            results, ran = run_tools(self.ex.task, uses)
            out, err = ran[0][2], bool(results[0]["is_error"])
            msgs.append({"role": "user", "content": results})
        else:  # it made no call: the step runs as asked (the scripted fallback's way)
            out, err = run_tool(self.ex.task, name, args)
            msgs.append({"role": "user", "content": f"[{name}({json.dumps(args)})] -> {out}"})
        for _ in range(SUB_TURNS - 1):
            await self.ask(msgs, agent)
        return out, err

    async def compact(self, messages: list[dict[str, Any]], prompt: str) -> list[dict[str, Any]]:
        """The summary call (role main_summary at the proxy), then the conversation restarted from it."""
        last = dict(messages[-1])
        blocks = (
            last["content"]
            if isinstance(last["content"], list)
            else [{"type": "text", "text": last["content"]}]
        )
        last["content"] = [*blocks, {"type": "text", "text": COMPACT_PROMPT}]
        resp = await self.post([*messages[:-1], last], "")
        summary = _text(resp)
        return [{"role": "user", "content": f"{prompt}\n\nSummary of the work so far: {summary}"}]


def failed(resp: dict[str, Any]) -> bool:
    """A reply worth sending again: cut at max_tokens, or a tool call the proxy could not parse."""
    content = resp.get("content") or []
    if any(b.get("type") == "tool_use" for b in content):
        return False
    return resp.get("stop_reason") == "max_tokens" or "<tool_call>" in _text(resp)


def context_tokens(resp: dict[str, Any]) -> int:
    """The call's whole context: input (uncached, cache-read and cache-written parts, as the Messages
    API splits them) plus output tokens."""
    usage = resp.get("usage") or {}
    keys = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens", "output_tokens")
    return sum(int(usage.get(k) or 0) for k in keys)


def _text(resp: dict[str, Any]) -> str:
    return "".join(b.get("text", "") for b in resp.get("content") or [] if b.get("type") == "text")


async def _tool_step(
    c: _Caller, uses: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[tuple[str, str, str]]]:
    """The model's tool calls, each through a sub-agent when configured, as tool_result blocks."""
    if not c.policy.subagents:
        return run_tools(c.ex.task, uses)
    results, ran = [], []
    for u in uses:
        given = u.get("input")
        args: dict[str, Any] = given if isinstance(given, dict) else {}
        out, err = await c.delegate(str(u.get("name", "")), args)
        ran.append((str(u.get("name", "")), json.dumps(args), out))
        results.append({"type": "tool_result", "tool_use_id": u["id"], "content": out, "is_error": err})
    return results, ran


async def run_branching(
    http: httpx.AsyncClient,
    proxy_url: str,
    ex: Execution,
    policy: Branching,
    *,
    turns: int,
    max_tokens: int,
    temperature: float,
    retry_for_s: float,
    scripted_fallback: bool = False,
) -> Execution:
    """Run one execution to its end (the caller applies the hard timeout by cancelling)."""
    c = _Caller(http, f"{proxy_url}/e/{ex.execution_id}/v1/messages", ex, policy, max_tokens, temperature,
                retry_for_s)  # fmt: skip
    script = list(ex.task.script)
    ex.messages = [{"role": "user", "content": ex.task.prompt}]
    for turn in range(turns):
        await asyncio.sleep(ex.tool_s / turns)
        resp = await c.ask(ex.messages)
        content = resp.get("content") or []
        ex.final_text = _text(resp)
        uses = [b for b in content if b.get("type") == "tool_use"]
        if turn == turns - 1:
            ex.turns.append(TurnLog(ToolSource.MODEL if uses else _missed(script)))
            break
        ex.messages.append({"role": "assistant", "content": content or [{"type": "text", "text": ""}]})
        user: str | list[dict[str, Any]]
        if uses:
            user, ran = await _tool_step(c, uses)
            del script[: len(uses)]
            ex.turns.append(TurnLog(ToolSource.MODEL, tuple(ran)))
        elif scripted_fallback and script:
            step = script.pop(0)
            if policy.subagents:
                out, _ = await c.delegate(step.name, step.arguments)
            else:
                out, _ = run_tool(ex.task, step.name, step.arguments)
            call = json.dumps(step.arguments)
            ex.turns.append(TurnLog(ToolSource.SCRIPT, ((step.name, call, out),)))
            user = f"[{step.name}({call})] -> {out}"
        elif scripted_fallback:
            ex.turns.append(TurnLog(ToolSource.NONE))
            user = "Give the final answer now."
        else:  # the model answered: the execution ends here
            ex.turns.append(TurnLog(_missed(script)))
            break
        ex.messages.append({"role": "user", "content": user})
        if policy.compact_tokens and context_tokens(resp) > policy.compact_tokens:
            ex.messages = await c.compact(ex.messages, ex.task.prompt)
    return ex


def _missed(script: list[Any]) -> ToolSource:
    return ToolSource.MISSED if script else ToolSource.NONE
