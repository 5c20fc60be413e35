"""The built-in harness on your own tasks (`[tasks] train`): one chat completion per execution, as verl's
single-turn rollout does. The row's prompt messages go as they are to gyre-proxy's OpenAI front
(`/e/{execution}/v1/chat/completions`); the answer's text is what the reward function is given. The
execution's tool time (the duration profile's share, `[agent] model_fraction`) is slept before the call;
overloaded and failed calls are retried as the built-in agent retries them (`agent.call_proxy`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx

from gyre.rollout.agents.agent import call_proxy
from gyre.rollout.tasks.dataset import DatasetTask


@dataclass
class ChatExecution:
    execution_id: str
    group_id: str
    task: DatasetTask
    tool_s: float
    calls: int = 0
    final_text: str | None = None
    """The answer's text; None until the call completed."""
    retries: int = 0

    def tool_calls(self) -> dict[str, int]:
        return {}


async def run_chat(
    http: httpx.AsyncClient,
    proxy_url: str,
    ex: ChatExecution,
    *,
    max_tokens: int,
    temperature: float,
    retry_for_s: float,
) -> ChatExecution:
    """Run one execution to its end (the caller applies the hard timeout by cancelling)."""
    await asyncio.sleep(ex.tool_s)
    body = {
        "model": "gyre-policy",
        "messages": ex.task.chat(),
        "max_tokens": max_tokens,
        "temperature": temperature,
    }
    url = f"{proxy_url}/e/{ex.execution_id}/v1/chat/completions"
    until = asyncio.get_running_loop().time() + retry_for_s
    resp = await call_proxy(http, url, body, ex, until)
    ex.calls += 1
    choices = resp.get("choices") or [{}]
    ex.final_text = str((choices[0].get("message") or {}).get("content") or "")
    return ex
