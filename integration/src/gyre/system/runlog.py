"""The run's per-step log (`RunLog`, a part that rides along every `gyre run`): each applied step's
scalars (`measure.scalars.step_scalars`: its `steps.jsonl` line, the trajectory service's summary of it,
throughput, and the cells' switch times so far) to TensorBoard under out_dir/tb/ and, with `[log]
wandb_project`, to Weights & Biases, at the step's number; a step above `[train] mismatch_warn` is also
said on the run's output. Steps already in `steps.jsonl` when it starts were logged by the process that
ran them (a resumed run) and are not written again.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from gyre.config.runconfig import Config
from gyre.measure.runmetrics import switch_times
from gyre.measure.scalars import ScalarLog, step_scalars
from gyre.system.runparts import RunContext


class RunLog:
    """Made by each attempt of the run (`Attempt.build`), so a new attempt starts one of its own."""

    name = "run-log"

    def __init__(self, cfg: Config, say: Any = print) -> None:
        self.cfg = cfg
        self.say = say
        self.logged = -1
        """Lines of steps.jsonl handled so far (-1: not started)."""
        self.prev_end: float | None = None
        self.ctx: RunContext | None = None
        self.writer: ScalarLog | None = None

    def start(self, ctx: RunContext) -> None:
        self.ctx = ctx
        if self.writer is None:
            self.writer = ScalarLog(ctx.out, self.cfg.log, suffix=".run", config=self.cfg.to_dict())
        lines = self._lines(ctx.out)
        if self.logged < 0:
            self.logged = len(lines)
            self.prev_end = lines[-1]["t_end"] if lines else None
        self.logged = min(self.logged, len(lines))  # a new attempt kept only the checkpoint's steps

    @staticmethod
    def _lines(out: Path) -> list[dict[str, Any]]:
        p = out / "steps.jsonl"
        if not p.exists():
            return []
        rows = []
        for x in p.read_text().splitlines():
            try:
                rows.append(json.loads(x))
            except json.JSONDecodeError:  # the core is writing it
                break
        return rows

    def tick(self, ctx: RunContext, final: bool = False) -> None:
        assert self.writer is not None, "start() comes first"
        lines = self._lines(ctx.out)
        for line in lines[self.logged :]:
            k = int(line["queue_position"]) - 1
            sd = ctx.traj.steps.get(k)
            summary = sd.summary if sd is not None else {}
            if not summary and not final:
                return  # its summary comes once the trajectory service sees the step applied
            scalars = step_scalars(line, summary, self.prev_end)
            scalars.update(self._switches(ctx))
            self.writer.write(k + 1, scalars)
            self._warn(k, line)
            self.logged += 1
            self.prev_end = float(line["t_end"])

    @staticmethod
    def _switches(ctx: RunContext) -> dict[str, float]:
        out: dict[str, float] = {}
        for kind, times in switch_times(ctx.sampler.samples).items():
            out[f"switch/{kind}_count"] = float(len(times))
            if times:
                out[f"switch/{kind}_mean"] = statistics.fmean(times)
        return out

    def _warn(self, k: int, line: dict[str, Any]) -> None:
        m = line.get("mismatch") or {}
        limit = self.cfg.train.mismatch_warn
        if limit > 0 and m.get("tokens") and m["abs_mean"] > limit:
            self.say(
                f"gyre run: WARNING step {k + 1}: train-inference mismatch {m['abs_mean']:.4f} (mean "
                f"|trainer - engine logprob| over {m['tokens']} on-policy tokens, max {m['abs_max']:.4f}) "
                f"is above [train] mismatch_warn = {limit:g}"
            )

    def done(self) -> bool:
        return True

    def stop(self) -> None:
        """Write the steps still waiting for their summary, then close the writers."""
        if self.writer is None:
            return
        try:
            if self.ctx is not None:
                self.tick(self.ctx, final=True)
        finally:
            self.writer.close()
            self.writer = None
