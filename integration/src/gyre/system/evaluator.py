"""The held-out evaluator of a run: a part that rides along (`runparts.py`) and evaluates the policy at
weight versions 0, `every`, 2 x `every`, ... and the last (`rollout.evalset`: what one evaluation runs).

An evaluation at version v starts once the trainer has applied v steps and every rollout engine serves v
(the sampler's newest reading); the trajectory service holds step v until it is done (`hold_at`), so all
its calls see one version (rollout of the next batches goes on meanwhile). Its executions count in the
water level the scheduler sees (the driver tracks them). Results go to `evals.jsonl` in the run
directory, one line per evaluation. An evaluation that raises fails the run, naming it.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from gyre.config.runconfig import Config
from gyre.measure.samples import engines_serve
from gyre.rollout.evalset import EVALS, append_result, eval_points, eval_set_of, evaluate_at
from gyre.system.runparts import RunContext


class Evaluator:
    name = "evaluator"

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.evals = eval_set_of(cfg)
        self.points = eval_points(cfg.run.steps, cfg.eval.every)
        self.results: list[dict[str, Any]] = []
        self._thread: threading.Thread | None = None
        self._result: dict[str, Any] | None = None
        self._error: BaseException | None = None

    # ---- RunPart ------------------------------------------------------------------------------------
    def start(self, ctx: RunContext) -> None:
        (ctx.out / EVALS).unlink(missing_ok=True)
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
        v = self.points[0] if self.points else None
        if v is not None and ctx.traj.applied == v and engines_serve(ctx.sampler.samples, v):
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
        append_result(ctx.out / EVALS, result)
        self.points.pop(0)
        self._thread, self._result = None, None
        ctx.traj.hold_at = self.points[0] if self.points and self.points[0] < self.cfg.run.steps else None

    def _run(self, ctx: RunContext, version: int) -> None:
        try:
            self._result = asyncio.run(
                evaluate_at(
                    self.evals, version, ctx.proxy_url, self.cfg.agent, self.cfg.eval.max_tokens,
                    ctx.driver.track, ctx.driver.untrack,
                )
            )  # fmt: skip
        except BaseException as exc:
            self._error = exc
