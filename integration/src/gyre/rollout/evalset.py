"""The held-out evaluation of a run, as the rollout side runs it: the same `[eval] tasks` tasks of the
evaluation split (never trained on), run by the built-in agent with greedy decoding through the run's
proxy, and summarized: mean score over the scored executions, per family, evaluation failures (not scores
of 0) and who made the tool calls. When it runs (at weight versions 0, `every`, 2 x `every`, ... and the
last, `eval_points`) is the run's: `system/evaluator.py`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import numpy as np
from gyre_traj.records import EvalStatus, Score

from gyre.config.runconfig import AgentSection
from gyre.rollout.agents.agent import Execution, HarnessError, run_execution
from gyre.rollout.tasks.qa import Task, evaluate


def eval_points(steps: int, every: int) -> list[int]:
    return sorted(set(range(0, steps + 1, every)) | {steps})


async def evaluate_at(
    tasks: Sequence[Task],
    version: int,
    proxy_url: str,
    a: AgentSection,
    max_tokens: int,
    track: Callable[[str], None],
    untrack: Callable[[str, bool], None],
) -> dict[str, Any]:
    """Run every task once, greedily, through the proxy (the engines serve `version`), each execution
    `track`ed while it runs (the water level counts it) and `untrack`ed with whether it timed out; the
    summary (`summarize`)."""
    t0 = time.time()
    timeout = httpx.Timeout(a.request_timeout_s, connect=5.0)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None)) as http:

        async def one(i: int) -> tuple[Score, Execution]:
            task = tasks[i]
            ex = Execution(f"eval-v{version}-{i:03d}", f"eval-v{version}", task, 0.0)
            track(ex.execution_id)
            timed_out, error = False, ""
            try:
                await asyncio.wait_for(
                    run_execution(
                        http, proxy_url, ex, turns=a.turns, max_tokens=max_tokens, temperature=0.0,
                        retry_for_s=a.timeout_s, scripted_fallback=a.scripted_fallback,
                    ),
                    timeout=a.timeout_s,
                )  # fmt: skip
            except TimeoutError:
                timed_out = True
            except (HarnessError, httpx.HTTPError) as exc:
                error = f"{type(exc).__name__}: {exc}"
            finally:
                untrack(ex.execution_id, timed_out)
            return evaluate(
                task, ex.execution_id, ex.group_id, ex.final_text, timed_out, error, ex.model_calls()
            ), ex

        done = await asyncio.gather(*(one(i) for i in range(len(tasks))))
    return summarize(version, t0, done)


def summarize(version: int, t0: float, done: Sequence[tuple[Any, Execution]]) -> dict[str, Any]:
    valid = [(s, ex) for s, ex in done if s.status is EvalStatus.OK]
    fams: dict[str, list[float]] = {}
    for s, ex in valid:
        fams.setdefault(ex.task.family, []).append(float(s.value))
    tools = {"model": 0, "script": 0, "missed": 0}
    for _, ex in done:
        for k, n in ex.tool_calls().items():
            tools[k] += n
    return {
        "version": version,
        "t_start": t0,
        "t_end": time.time(),
        "tasks": len(done),
        "score": round(float(np.mean([s.value for s, _ in valid])), 4) if valid else None,
        "by_family": {f: round(float(np.mean(v)), 4) for f, v in sorted(fams.items())},
        "eval_failed": len(done) - len(valid),
        "timed_out": sum(s.timed_out for s, _ in valid),
        "tool_calls": tools,
        "answers": {ex.execution_id: ex.final_text for _, ex in done},
    }
