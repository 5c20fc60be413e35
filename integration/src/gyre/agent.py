"""The built-in harness: a scripted, tool-using agent that talks to the policy over the Anthropic API.

One execution is `turns` model calls to gyre-proxy's `/e/{execution}/v1/messages` with the built-in
tools. When the model emits a `tool_use`, the harness runs that tool and answers with a `tool_result`;
otherwise it runs the next call of the task's script itself and hands the output over as a user turn
(the tiny random model rarely produces a well-formed call). Tool time is a sleep before each call, so an
execution's length follows the configured heavy-tailed profile. The harness keeps its progress in an
`Execution` record, so a run cut by the driver's timeout can still be scored on what it produced.
Overloaded answers (529/503: no rollout engine while the pool trains) are retried.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import httpx

from gyre.tasks import TOOLS, Task, run_tool

RETRYABLE = (409, 429, 503, 529)


class HarnessError(RuntimeError):
    """The proxy refused a call in a way a retry cannot fix."""


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


async def _call(
    http: httpx.AsyncClient, url: str, body: dict[str, Any], ex: Execution, retry_until: float
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    while True:
        r = await http.post(url, json=body)
        if r.status_code == 200:
            out: dict[str, Any] = r.json()
            return out
        if r.status_code in RETRYABLE and loop.time() < retry_until:
            ex.retries += 1
            await asyncio.sleep(0.25)
            continue
        raise HarnessError(f"{ex.execution_id}: proxy answered {r.status_code}: {r.text[:300]}")


async def run_execution(
    http: httpx.AsyncClient,
    proxy_url: str,
    ex: Execution,
    *,
    turns: int,
    max_tokens: int,
    temperature: float,
    retry_for_s: float,
) -> Execution:
    """Run one execution to its end (the caller applies the hard timeout by cancelling)."""
    url = f"{proxy_url}/e/{ex.execution_id}/v1/messages"
    loop = asyncio.get_running_loop()
    script = list(ex.task.script)
    ex.messages = [{"role": "user", "content": ex.task.prompt}]
    for turn in range(turns):
        await asyncio.sleep(ex.tool_s / turns)
        body = {
            "model": "gyre-policy",
            "max_tokens": max_tokens,
            "temperature": temperature,
            "system": "You are a careful assistant. Use the tools, then answer briefly.",
            "tools": TOOLS,
            "messages": ex.messages,
        }
        resp = await _call(http, url, body, ex, loop.time() + retry_for_s)
        ex.calls += 1
        content = resp.get("content") or []
        texts = [b.get("text", "") for b in content if b.get("type") == "text"]
        ex.final_text = "".join(texts)
        if turn == turns - 1:
            break
        ex.messages.append({"role": "assistant", "content": content or [{"type": "text", "text": ""}]})
        uses = [b for b in content if b.get("type") == "tool_use"]
        if uses:
            results = []
            for u in uses:
                args = u.get("input") or {}
                arg = next((v for v in args.values() if isinstance(v, str)), json.dumps(args))
                out, err = run_tool(str(u.get("name", "")), arg)
                results.append(
                    {"type": "tool_result", "tool_use_id": u["id"], "content": out, "is_error": err}
                )
            ex.messages.append({"role": "user", "content": results})
        elif script:
            step = script.pop(0)
            out, _ = run_tool(step.name, step.argument)
            ex.messages.append({"role": "user", "content": f"[{step.name}({step.argument})] -> {out}"})
        else:
            ex.messages.append({"role": "user", "content": "Give the final answer now."})
    return ex
