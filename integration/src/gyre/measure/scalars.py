"""Scalars of a run to TensorBoard (event files under the run directory's `tb/`) and, with a `[log]
wandb_project`, to Weights & Biases (the `gyre[wandb]` extra): one writer for `gyre run`'s per-step
scalars and the demo's own. `step_scalars` turns a step's `steps.jsonl` line and the trajectory service's
summary of it into flat named numbers, the same ones in both places.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gyre.config.runconfig import LogSection

SKIP = frozenset({"step", "t_start", "t_end", "first_given_at", "closed_at"})
"""Numbers of a step's line that are not scalars to plot (its index and wall-clock instants)."""


class WandbMissing(ImportError):
    """`[log] wandb_project` is set but wandb is not installed (the `gyre[wandb]` extra)."""


def flatten(prefix: str, value: Any, out: dict[str, float]) -> dict[str, float]:
    """Every finite number in `value` (nested mappings by `/`-joined key; booleans as 0 or 1) into `out`."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            if str(k) not in SKIP:
                flatten(f"{prefix}/{k}" if prefix else str(k), v, out)
    elif isinstance(value, bool) or (isinstance(value, int | float) and math.isfinite(value)):
        out[prefix] = float(value)
    return out


def step_scalars(
    line: Mapping[str, Any], summary: Mapping[str, Any], prev_end: float | None
) -> dict[str, float]:
    """One applied step's scalars: its `steps.jsonl` line under `train/` (loss, grad_norm, mismatch, the
    loss metrics, staleness, micro-batches per replica, the engine push), the trajectory service's summary
    under `rollout/` (`rollout/mean_score` is the reward), and `train/tokens_per_s`: the step's trained
    tokens over the time since the previous step ended (`prev_end`; its own start for the first)."""
    out = flatten("train", line, {})
    flatten("rollout", summary, out)
    start = prev_end if prev_end is not None else line.get("t_start")
    tokens = summary.get("tokens")
    if isinstance(tokens, int | float) and start is not None and line.get("t_end", 0) > start:
        out["train/tokens_per_s"] = float(tokens) / (float(line["t_end"]) - float(start))
    return out


class ScalarLog:
    """Writes named scalars at integer steps to `out/tb/` (TensorBoard; `suffix` tells this writer's
    event files from another's in the same directory) and, with `log.wandb_project` and a mode other than
    disabled, to a W&B run in `out/` (offline by default: `wandb sync out/wandb/offline-run-*` uploads
    it). W&B steps must grow: write each step once, in order."""

    def __init__(
        self,
        out: Path,
        log: LogSection | None = None,
        suffix: str = "",
        config: Mapping[str, Any] | None = None,
    ) -> None:
        from tensorboardX import SummaryWriter

        self.tb = SummaryWriter(str(out / "tb"), filename_suffix=suffix)
        self.wandb: Any = None
        if log is not None and log.wandb_project and log.wandb_mode != "disabled":
            try:
                import wandb
            except ImportError as exc:
                self.tb.close()
                raise WandbMissing(
                    f"[log] wandb_project = {log.wandb_project!r} needs wandb: install the extra, "
                    "`pip install 'gyre[wandb]'`"
                ) from exc
            self.wandb = wandb.init(
                project=log.wandb_project,
                entity=log.wandb_entity or None,
                mode=log.wandb_mode,  # type: ignore[arg-type]
                dir=str(out),
                name=out.name,
                config=dict(config or {}),
                settings=wandb.Settings(console="off", silent=True),
            )

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        for name, value in scalars.items():
            self.tb.add_scalar(name, value, step)
        self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(dict(scalars), step=step)

    def close(self) -> None:
        self.tb.close()
        if self.wandb is not None:
            run, self.wandb = self.wandb, None
            run.finish()
            # finish() returns before wandb's service has written the offline run's file out; teardown
            # waits for it, so the run directory is complete when close() returns, not only at exit
            import wandb

            wandb.teardown()
