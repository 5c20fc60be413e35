"""The held-out evaluation of a run: the same `[eval] tasks` tasks of the evaluation split (never trained
on), run by the built-in harness with greedy decoding through the same proxy and engines as training,
at weight versions 0, `every`, 2 x `every`, ... and the last.

An evaluation at version v starts once the trainer has applied v steps and every rollout engine serves
v; the trajectory service holds step v until it is done, so all its calls see one version (rollout of the
next batches goes on meanwhile). Its executions count in the water level the scheduler sees. Results go
to `evals.jsonl` in the run directory, one line per evaluation: mean score over the scored executions,
per family, evaluation failures (not scores of 0) and who made the tool calls.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import httpx
import numpy as np
from gyre_sched.protocol import Role
from gyre_traj.records import EvalStatus

from gyre.config.runconfig import Config
from gyre.rollout.agents.agent import Execution, HarnessError, run_execution
from gyre.rollout.tasks.qa import eval_set, evaluate
from gyre.system.runparts import RunContext


def eval_points(steps: int, every: int) -> list[int]:
    return sorted(set(range(0, steps + 1, every)) | {steps})


def engines_serve(ctx: RunContext, version: int) -> bool:
    """No cell mid-switch, and every rollout engine serves `version` or newer (the sampler's view)."""
    if not ctx.sampler.samples:
        return False
    last = ctx.sampler.samples[-1]
    if any(r not in (int(Role.ROLLOUT), int(Role.TRAINING)) for r in last.roles.values()):
        return False
    rollout = [c for c, r in last.roles.items() if r == int(Role.ROLLOUT)]
    versions = [last.engine_version.get(c) for c in rollout]
    return bool(rollout) and all(v is not None and v.isdigit() and int(v) >= version for v in versions)


class Evaluator:
    name = "evaluator"

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.tasks = eval_set(cfg.eval.tasks, cfg.eval.seed)
        self.points = eval_points(cfg.run.steps, cfg.eval.every)
        self.results: list[dict[str, Any]] = []
        self._thread: threading.Thread | None = None
        self._result: dict[str, Any] | None = None
        self._error: BaseException | None = None

    # ---- RunPart ------------------------------------------------------------------------------------
    def start(self, ctx: RunContext) -> None:
        (ctx.out / "evals.jsonl").unlink(missing_ok=True)
        ctx.traj.hold_at = self.points[0]

    def tick(self, ctx: RunContext) -> None:
        if self._error is not None:
            raise RuntimeError(f"evaluation failed: {self._error}") from self._error
        if self._thread is not None:
            if self._thread.is_alive():
                return
            assert self._result is not None
            self._finish(ctx, self._result)
            return
        if self.points and ctx.traj.applied == self.points[0] and engines_serve(ctx, self.points[0]):
            v = self.points[0]
            self._thread = threading.Thread(target=self._run, args=(ctx, v), name=f"eval-v{v}", daemon=True)
            self._thread.start()

    def done(self) -> bool:
        return not self.points and self._thread is None

    def stop(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=30.0)

    # ---- one evaluation -----------------------------------------------------------------------------
    def _finish(self, ctx: RunContext, result: dict[str, Any]) -> None:
        self.results.append(result)
        with open(ctx.out / "evals.jsonl", "a") as fh:
            fh.write(json.dumps(result) + "\n")
        self.points.pop(0)
        self._thread, self._result = None, None
        ctx.traj.hold_at = self.points[0] if self.points and self.points[0] < self.cfg.run.steps else None

    def _run(self, ctx: RunContext, version: int) -> None:
        try:
            self._result = asyncio.run(self._evaluate(ctx, version))
        except BaseException as exc:
            self._error = exc

    async def _evaluate(self, ctx: RunContext, version: int) -> dict[str, Any]:
        a, e = self.cfg.agent, self.cfg.eval
        t0 = time.time()
        timeout = httpx.Timeout(a.request_timeout_s, connect=5.0)
        async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None)) as http:

            async def one(i: int) -> tuple[Any, Execution]:
                task = self.tasks[i]
                ex = Execution(f"eval-v{version}-{i:03d}", f"eval-v{version}", task, 0.0)
                ctx.driver.track(ex.execution_id)
                timed_out, error = False, ""
                try:
                    await asyncio.wait_for(
                        run_execution(
                            http, ctx.proxy_url, ex, turns=a.turns, max_tokens=e.max_tokens, temperature=0.0,
                            retry_for_s=a.timeout_s, scripted_fallback=a.scripted_fallback,
                        ),
                        timeout=a.timeout_s,
                    )  # fmt: skip
                except TimeoutError:
                    timed_out = True
                except (HarnessError, httpx.HTTPError) as exc:
                    error = f"{type(exc).__name__}: {exc}"
                finally:
                    ctx.driver.untrack(ex.execution_id, timed_out)
                return evaluate(
                    task, ex.execution_id, ex.group_id, ex.final_text, timed_out, error, ex.model_calls()
                ), ex

            done = await asyncio.gather(*(one(i) for i in range(len(self.tasks))))
        return summarize(version, t0, done)


def summarize(version: int, t0: float, done: list[tuple[Any, Execution]]) -> dict[str, Any]:
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
