"""The held-out evaluation of a run, as the rollout side runs it: the same `[eval] tasks` tasks of the
evaluation split (never trained on; `eval_set_of`: the built-in questions' held-out split, or your
`[tasks]` evaluation rows), run with greedy decoding through the run's proxy (the built-in agent on the
built-in tasks; one chat completion, scored by your reward function, on yours), and summarized: mean
score over the scored executions, per family (your rows' `data_source`), evaluation failures (not scores
of 0), who made the tool calls, and the means of your reward's extra keys. When it runs (at weight
versions 0, `every`, 2 x `every`, ... and the last, `eval_points`) is the run's: `system/evaluator.py`;
`gyre eval` runs one on a checkpoint (`system/evalonly.py`). `append_result` writes either's line.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from gyre_traj.records import EvalStatus, Score

from gyre.config.runconfig import AgentSection, Config
from gyre.rollout.agents.agent import Execution, HarnessError, run_execution
from gyre.rollout.agents.chat import ChatExecution, run_chat
from gyre.rollout.harnesses import check_tasks
from gyre.rollout.tasks.dataset import DatasetTask, eval_subset
from gyre.rollout.tasks.qa import Task, eval_set, evaluate
from gyre.rollout.tasks.reward import Reward

EVALS = "evals.jsonl"
"""One line per evaluation, in the run directory (or `gyre eval`'s)."""


@dataclass(frozen=True)
class EvalSet:
    """The tasks every evaluation of a run scores, and your reward function when they are yours."""

    tasks: tuple[Task, ...] | tuple[DatasetTask, ...]
    reward: Reward | None = None


def eval_set_of(cfg: Config, n: int | None = None) -> EvalSet:
    """`n` (default `[eval] tasks`) tasks of the evaluation split, chosen by `[eval] seed`: the built-in
    questions', or `[tasks]`'s evaluation rows (all of them when there are no more)."""
    n = cfg.eval.tasks if n is None else n
    own = check_tasks(cfg)
    if own is None:
        return EvalSet(tuple(eval_set(n, cfg.eval.seed)))
    tasks, reward = own
    return EvalSet(tuple(eval_subset(tasks.eval, n, cfg.eval.seed)), reward)


def append_result(path: Path, result: dict[str, Any]) -> None:
    """One evaluation's summary as a line of `path` (evals.jsonl)."""
    with open(path, "a") as fh:
        fh.write(json.dumps(result) + "\n")


def eval_points(steps: int, every: int) -> list[int]:
    return sorted(set(range(0, steps + 1, every)) | {steps})


async def evaluate_at(
    evals: EvalSet,
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

        async def one(i: int) -> tuple[Score, Execution | ChatExecution, dict[str, float]]:
            task = evals.tasks[i]
            eid, gid = f"eval-v{version}-{i:03d}", f"eval-v{version}"
            ex: Execution | ChatExecution
            run: Coroutine[Any, Any, Execution | ChatExecution]
            if isinstance(task, DatasetTask):
                ex = ChatExecution(eid, gid, task, 0.0)
                run = run_chat(
                    http, proxy_url, ex, max_tokens=max_tokens, temperature=0.0, retry_for_s=a.timeout_s
                )
            else:
                ex = Execution(eid, gid, task, 0.0)
                run = run_execution(
                    http, proxy_url, ex, turns=a.turns, max_tokens=max_tokens, temperature=0.0,
                    retry_for_s=a.timeout_s, scripted_fallback=a.scripted_fallback,
                )  # fmt: skip
            track(ex.execution_id)
            timed_out, error = False, ""
            try:
                await asyncio.wait_for(run, timeout=a.timeout_s)
            except TimeoutError:
                timed_out = True
            except (HarnessError, httpx.HTTPError) as exc:
                error = f"{type(exc).__name__}: {exc}"
            finally:
                untrack(ex.execution_id, timed_out)
            if isinstance(ex, ChatExecution):
                assert evals.reward is not None, "your tasks come with your reward"
                score, extras = await evals.reward.score(
                    ex.task, ex.execution_id, ex.group_id, ex.final_text, timed_out, error
                )
                return score, ex, extras
            return (
                evaluate(
                    ex.task, ex.execution_id, ex.group_id, ex.final_text, timed_out, error, ex.model_calls()
                ),
                ex,
                {},
            )

        done = await asyncio.gather(*(one(i) for i in range(len(evals.tasks))))
    return summarize(version, t0, done)


def summarize(
    version: int, t0: float, done: Sequence[tuple[Score, Execution | ChatExecution, dict[str, float]]]
) -> dict[str, Any]:
    valid = [(s, ex, x) for s, ex, x in done if s.status is EvalStatus.OK]
    fams: dict[str, list[float]] = {}
    extras: dict[str, list[float]] = {}
    for s, ex, x in valid:
        fams.setdefault(ex.task.family, []).append(float(s.value or 0.0))
        for k, v in x.items():
            extras.setdefault(k, []).append(v)
    tools = {"model": 0, "script": 0, "missed": 0}
    for _, ex, _ in done:
        for k, n in ex.tool_calls().items():
            tools[k] += n
    out: dict[str, Any] = {
        "version": version,
        "t_start": t0,
        "t_end": time.time(),
        "tasks": len(done),
        "score": round(float(np.mean([s.value for s, _, _ in valid])), 4) if valid else None,
        "by_family": {f: round(float(np.mean(v)), 4) for f, v in sorted(fams.items())},
        "eval_failed": len(done) - len(valid),
        "timed_out": sum(s.timed_out for s, _, _ in valid),
        "tool_calls": tools,
        "answers": {ex.execution_id: ex.final_text for _, ex, _ in done},
    }
    if extras:
        out["reward_extra"] = {k: round(float(np.mean(v)), 4) for k, v in sorted(extras.items())}
    failed = {s.execution_id: s.detail for s, _, _ in done if s.status is not EvalStatus.OK}
    if failed:
        out["failures"] = failed
    return out
