"""The profile agent: executions shaped like the report's long agent runs, to measure the system at that
shape (`[agent] harness = "profile"`, `[profile]`).

An execution follows a plan drawn with the run's seed (`plan`): a number of main-agent calls, the output
length of each (the model samples exactly that many tokens: the OpenAI front's `ignore_eos`, so lengths
follow the profile while every token is the policy's own, recorded exactly), the size of the tool output
after each call (text of that many tokens of the policy's tokenizer, appended as the tool's answer, so
the context grows by it), the tool time slept before each call (the duration profile's tool share,
spread over the calls with lognormal weights) and which tool steps a sub-agent takes (a conversation of
its own, `X-Gyre-Agent: sub-N`, two calls, role subagent at the proxy; its answer goes back as the tool
output). Once a call's context passes `compact_tokens` the agent compacts: a summary call with Claude
Code's compaction request (role main_summary), then the conversation starts again from the task and the
summary. An execution ends after its planned calls, when its context would pass `context_max`, or at the
driver's timeout (the heavy tail of the duration profile). Its reward is a rule on the final answer that
any model can move (`score_text`: the share of digits); the workload measures the system, not ability.
Overloaded answers (409/429/503/529, other 5xx, a connection refused) are retried as harnesses do; a
call in flight when the timeout cancels the execution is waited for and counted (the proxy records it).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
from collections.abc import Coroutine
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from gyre.config.runconfig import ProfileSection
from gyre.rollout.agents.agent import RETRYABLE, HarnessError

COMPACT_PROMPT = (
    "Your task is to create a detailed summary of the conversation so far: the task, the tools called "
    "with their results, and what is left to do."
)
"""The compaction request (its opening is Claude Code's, which gyre-proxy classifies as a summary)."""
SYSTEM = "You are a coding agent. Work through the task with the tools; end with the answer."
SUB_CALLS = 2


@dataclass(frozen=True)
class Plan:
    """One execution's shape: per main call its output length, the tool output after it (tokens), the
    tool time before it (seconds) and whether a sub-agent takes the tool step after it."""

    outputs: tuple[int, ...]
    tool_tokens: tuple[int, ...]
    tool_s: tuple[float, ...]
    subagent: tuple[bool, ...]

    @property
    def calls(self) -> int:
        return len(self.outputs)


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(median * math.exp(sigma * rng.gauss(0.0, 1.0))))))


def calls_of(p: ProfileSection, seed: int, k: int, q: int, j: int) -> int:
    """The planned main-agent calls of execution j of query q of batch k (`planned_calls` adds its
    sub-agents' and summary calls)."""
    rng = random.Random(f"gyre-profile/{seed}/{k}/{q}/{j}")
    return _lognormal(rng, p.calls_median, p.calls_sigma, p.calls_min, p.calls_max)


def calls_array(p: ProfileSection, seed: int, shape: tuple[int, int, int]) -> np.ndarray:
    """`calls_of` for every execution of a run: shape (steps, queries, group_size)."""
    out = np.zeros(shape, dtype=np.int64)
    for k, q, j in np.ndindex(*shape):
        out[k, q, j] = calls_of(p, seed, k, q, j)
    return out


def planned_calls_array(p: ProfileSection, seed: int, shape: tuple[int, int, int]) -> np.ndarray:
    """`planned_calls` for every execution of a run, shape (steps, queries, group_size): every model call
    it makes when nothing cuts it short, sub-agents' and summary calls included (what the simulator
    counts: on the agent-shaped example, 15.0 calls an execution against 11.5 of the main agent)."""
    out = np.zeros(shape, dtype=np.int64)
    for k, q, j in np.ndindex(*shape):
        out[k, q, j] = planned_calls(plan(p, seed, k, q, j, 0.0), p, p.prompt_tokens)
    return out


def plan(p: ProfileSection, seed: int, k: int, q: int, j: int, tool_s: float) -> Plan:
    """Execution j of query q of batch k: its calls from `calls_of`, the rest drawn after them from the
    same seeded stream; `tool_s` (the duration profile's tool time) spread over the calls."""
    n = calls_of(p, seed, k, q, j)
    rng = random.Random(f"gyre-profile/{seed}/{k}/{q}/{j}/shape")
    outputs = tuple(
        _lognormal(rng, p.output_median, p.output_sigma, p.output_min, p.output_max) for _ in range(n)
    )
    tools = tuple(
        _lognormal(rng, p.tool_tokens_median, p.tool_tokens_sigma, p.tool_tokens_min, p.tool_tokens_max)
        for _ in range(n)
    )
    weights = [math.exp(p.tool_s_sigma * rng.gauss(0.0, 1.0)) for _ in range(n)]
    total = sum(weights)
    sleeps = tuple(tool_s * w / total for w in weights)
    subs = tuple(rng.random() < p.subagent_share for _ in range(n))
    return Plan(outputs, tools, sleeps, subs)


def _call_sleeps(plan: Plan, p: ProfileSection, start_tokens: int, wrap_tokens: int) -> list[float]:
    """Per model call an execution of `plan` makes when nothing cuts it short, in order, the tool seconds
    slept just before it (a main call's; 0 for sub-agents' and summary calls)."""
    out: list[float] = []
    ctx = start_tokens
    for i in range(plan.calls):
        out.append(plan.tool_s[i])
        after = ctx + plan.outputs[i]  # the call's context: its input and its output
        if i == plan.calls - 1 or after + plan.tool_tokens[i] + p.output_max > p.context_max:
            break
        if plan.subagent[i]:
            out += [0.0] * SUB_CALLS
            ctx = after + plan.outputs[i] + wrap_tokens  # the sub-agent's last answer is the tool output
        else:
            ctx = after + plan.tool_tokens[i] + wrap_tokens
        if p.compact_tokens and after + plan.tool_tokens[i] > p.compact_tokens:
            out.append(0.0)
            ctx = start_tokens + plan.outputs[i] + wrap_tokens
    return out


def planned_calls(plan: Plan, p: ProfileSection, start_tokens: int, wrap_tokens: int = 8) -> int:
    """The model calls an execution of `plan` makes when nothing cuts it short (sub-agents' and summary
    calls included), its contexts added up from the plan's token counts as `run_profile` adds them:
    `start_tokens` for the system prompt and task, `wrap_tokens` for the framing of each tool step and of
    the conversation after a compaction (the harness decides on the proxy's real counts, which differ
    from these by the chat template's few tokens a message)."""
    return len(_call_sleeps(plan, p, start_tokens, wrap_tokens))


def slept_s(plan: Plan, p: ProfileSection, calls: int, start_tokens: int, wrap_tokens: int = 8) -> float:
    """Tool seconds an execution of `plan` slept before its first `calls` calls: what an execution cut by
    the timeout after `calls` calls (the last one in flight when it struck) spent in tool time, where its
    outcome's `tool_s` is the whole plan's."""
    return float(sum(_call_sleeps(plan, p, start_tokens, wrap_tokens)[:calls]))


def planned_s(plan: Plan, p: ProfileSection, start_tokens: int, call_s: float) -> float:
    """Seconds an execution of `plan` takes to its end when each model call takes `call_s`: its tool time
    plus `planned_calls` calls (what `[agent] timeout_s` is set against: past it, the execution is cut)."""
    return sum(plan.tool_s) + planned_calls(plan, p, start_tokens) * call_s


class Filler:
    """Text of a given number of tokens of the policy's tokenizer, from its plain lower-case word pieces
    (re-tokenized it comes to about that many tokens; the proxy counts the real ones)."""

    def __init__(self, model_dir: str | Path) -> None:
        self.pieces = _pieces(str(Path(model_dir) / "tokenizer.json"))

    def text(self, rng: random.Random, tokens: int) -> str:
        return "".join(rng.choice(self.pieces) for _ in range(tokens)).strip()


@cache
def _pieces(tokenizer_json: str) -> tuple[str, ...]:
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(tokenizer_json).get_vocab()
    spaced = []
    for t in vocab:  # a space-led word piece: byte-level BPE writes the space as U+0120, SentencePiece U+2581
        word = t[1:] if t[:1] in ("\u0120", "\u2581") else ""
        if len(word) > 1 and word.isascii() and word.isalpha() and word.islower():
            spaced.append(" " + word)
    if len(spaced) < 50:
        raise ValueError(f"{tokenizer_json}: too few plain word pieces ({len(spaced)}) to write tool output")
    return tuple(sorted(spaced))


def score_text(text: str | None) -> float:
    """The profile workload's reward: the share of the final answer's non-space characters that are
    digits (any model can move it; 0.0 for an empty answer)."""
    chars = [c for c in text or "" if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


@dataclass
class ProfileExecution:
    execution_id: str
    group_id: str
    prompt: str
    tool_s: float
    plan: Plan
    calls: int = 0
    """Model calls that completed (each one is a TITO record at the proxy), sub-agents' included."""
    final_text: str | None = None
    retries: int = 0
    compactions: int = 0
    subagent_calls: int = 0
    context_max: int = 0
    """The largest context (input + output tokens) of any call, from the proxy's usage."""
    messages: list[dict[str, Any]] = field(default_factory=list)

    def tool_calls(self) -> dict[str, int]:
        return {}


@dataclass
class _Caller:
    http: httpx.AsyncClient
    url: str
    ex: ProfileExecution
    temperature: float
    retry_for_s: float

    async def call(self, messages: list[dict[str, Any]], tokens: int, agent: str = "") -> dict[str, Any]:
        """One chat completion of exactly `tokens` output tokens (retried while overloaded)."""
        body = {
            "model": "gyre-policy",
            "messages": messages,
            "max_tokens": tokens,
            "temperature": self.temperature,
            "ignore_eos": True,
        }
        headers = {"X-Gyre-Agent": agent} if agent else {}
        loop = asyncio.get_running_loop()
        until = loop.time() + self.retry_for_s
        while True:
            try:
                r = await self._finish(self.http.post(self.url, json=body, headers=headers))
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
                if loop.time() >= until:
                    raise
                self.ex.retries += 1
                await asyncio.sleep(0.25)
                continue
            if r.status_code == 200:
                self.ex.calls += 1
                out: dict[str, Any] = r.json()
                usage = out.get("usage") or {}
                ctx = int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)
                self.ex.context_max = max(self.ex.context_max, ctx)
                return out
            if (r.status_code in RETRYABLE or r.status_code >= 500) and loop.time() < until:
                self.ex.retries += 1
                await asyncio.sleep(0.25)
                continue
            raise HarnessError(f"{self.ex.execution_id}: proxy answered {r.status_code}: {r.text[:300]}")

    async def _finish(self, request: Coroutine[Any, Any, httpx.Response]) -> httpx.Response:
        """Cancelled by the driver's timeout while the call is at the proxy (which completes and records
        it anyway), wait for its response and count it before ending."""
        call = asyncio.ensure_future(request)
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            with contextlib.suppress(httpx.HTTPError, asyncio.CancelledError):
                if (await call).status_code == 200:
                    self.ex.calls += 1
            raise


def _text(resp: dict[str, Any]) -> str:
    choices = resp.get("choices") or [{}]
    return str((choices[0].get("message") or {}).get("content") or "")


def _context(resp: dict[str, Any]) -> int:
    usage = resp.get("usage") or {}
    return int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)


async def run_profile(
    http: httpx.AsyncClient,
    proxy_url: str,
    ex: ProfileExecution,
    p: ProfileSection,
    filler: Filler,
    *,
    temperature: float,
    retry_for_s: float,
) -> ProfileExecution:
    """Run one execution to its end (the caller applies the hard timeout by cancelling)."""
    c = _Caller(http, f"{proxy_url}/e/{ex.execution_id}/v1/chat/completions", ex, temperature, retry_for_s)
    rng = random.Random(f"{ex.execution_id}/text")
    start = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ex.prompt}]
    ex.messages = list(start)
    plan_ = ex.plan
    for i in range(plan_.calls):
        await asyncio.sleep(plan_.tool_s[i])
        resp = await c.call(ex.messages, plan_.outputs[i])
        ex.final_text = _text(resp)
        last = i == plan_.calls - 1
        if last or _context(resp) + plan_.tool_tokens[i] + p.output_max > p.context_max:
            break
        ex.messages.append({"role": "assistant", "content": ex.final_text})
        if plan_.subagent[i]:
            out = await _subagent(c, filler, rng, plan_.tool_tokens[i], plan_.outputs[i])
        else:
            out = filler.text(rng, plan_.tool_tokens[i])
        ex.messages.append({"role": "user", "content": f"Tool output:\n{out}"})
        if p.compact_tokens and _context(resp) + plan_.tool_tokens[i] > p.compact_tokens:
            ex.messages.append({"role": "user", "content": COMPACT_PROMPT})
            summary = _text(await c.call(ex.messages, plan_.outputs[i]))
            ex.compactions += 1
            ex.messages = [*start[:1], {"role": "user", "content": f"{ex.prompt}\n\nSummary: {summary}"}]
    return ex


async def _subagent(c: _Caller, filler: Filler, rng: random.Random, tokens: int, output: int) -> str:
    """A sub-agent's conversation: its task with half the tool output, a call, the other half, a call;
    its last answer is the main agent's tool output."""
    c.ex.subagent_calls += SUB_CALLS
    agent = f"sub-{c.ex.subagent_calls // SUB_CALLS}"
    half = max(1, tokens // 2)
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Subtask. Read this and report:\n{filler.text(rng, half)}"},
    ]
    answer = ""
    for k in range(SUB_CALLS):
        answer = _text(await c.call(msgs, output, agent))
        if k < SUB_CALLS - 1:
            msgs += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": f"Tool output:\n{filler.text(rng, half)}"},
            ]
    return answer
