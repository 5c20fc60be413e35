"""`gyre compare CONFIG`: one workload under several arms (a policy, optionally with streaming forced on
or off), measured side by side, with the gyre-sched simulator's prediction for the same configuration
next to each measurement.

An arm is `POLICY` (the config's `[driver] streaming`), `POLICY:streaming` or `POLICY:whole` (whole steps).
Each arm gets `repeats` full `gyre run`s (fresh processes, the same seed, so the same tasks and the same
duration sample) in `out_dir/<arm>/` (one repeat) or `out_dir/<arm>/r<i>/`; the figures of an arm are
medians over its repeats. Afterwards the machine-dependent times the simulator needs (cell-seconds of
training per group, weight push, switch times, seconds per model call, the seconds past the timeout that
executions cut by it kept their slots) are taken from every measured run (`predict.calibrate`) and the
simulator runs each arm on the same duration sample, with the arm's streaming. The
table and `compare.json` hold both, and the end-to-end ratios against the first arm.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from gyre.config.runconfig import Config, ConfigError
from gyre.measure.arms import arm_config, table, tabulate
from gyre.measure.metrics import write_json
from gyre.measure.predict import Slept
from gyre.procs.group import ProcessGroup
from gyre.rollout.agents import profile
from gyre.system.attempt import RunError, ensure_model
from gyre.system.run import run


def _arm_dir(root: Path, arm: str, i: int, repeats: int) -> Path:
    d = root / arm.replace(":", "-")
    return d if repeats == 1 else d / f"r{i}"


def predicted(
    cfg: Config, configs: dict[str, Config], measured: dict[str, list[dict[str, Any]]], repeats: int = 1
) -> dict[str, Any]:
    """The table of measured runs (`metrics.json` of each arm's repeats) beside the simulator's prediction
    for each arm's config, calibrated on all of them (`arms.tabulate`): what `compare` does after its runs,
    or with `reuse` instead of them."""
    calls, slept = planned_calls(cfg)
    return tabulate(cfg, configs, measured, repeats, calls, slept)


def planned_calls(cfg: Config) -> tuple[np.ndarray | None, Slept | None]:
    """For the profile harness, what the simulator's calibration and prediction take from each execution's
    plan: its planned calls (steps x queries x group size) and the tool seconds it slept before the calls
    it made; (None, None) for other harnesses."""
    if cfg.agent.harness != "profile":
        return None, None
    shape = (cfg.run.steps, cfg.batch.queries, cfg.batch.group_size)
    p, seed = cfg.profile, cfg.run.seed

    def slept(where: tuple[int, int, int], made: int, tool_s: float) -> float:
        return profile.slept_s(profile.plan(p, seed, *where, tool_s), p, made, p.prompt_tokens)

    return profile.planned_calls_array(p, seed, shape), slept


def compare(
    cfg: Config, arms: list[str], say: Any = print, reuse: bool = False, repeats: int = 1
) -> dict[str, Any]:
    """Run each arm `repeats` times (or, with `reuse`, read the `metrics.json` of earlier runs, e.g. made on
    another machine), then predict each with the simulator and tabulate."""
    if repeats < 1:
        raise ConfigError("repeats must be >= 1")
    root = Path(cfg.run.out_dir).resolve()
    configs = {a: arm_config(cfg, a, str(root)) for a in arms}  # refuses a bad arm before anything runs
    if not reuse and not cfg.run.model_dir:  # one embedded model for every run
        procs = ProcessGroup(root / "logs")
        try:
            model = ensure_model(cfg, root, procs)
        finally:
            procs.close()
        configs = {a: replace(c, run=replace(c.run, model_dir=str(model))) for a, c in configs.items()}
    measured: dict[str, list[dict[str, Any]]] = {}
    for i in range(repeats):  # repeat-major: the machine's load drifts over every arm alike
        for a, c in configs.items():
            d = _arm_dir(root, a, i, repeats)
            if reuse:
                if not (d / "metrics.json").exists():
                    raise RunError(
                        f"--reuse: no {d / 'metrics.json'}; run `gyre compare --policies {a}` first"
                    )
                m = json.loads((d / "metrics.json").read_text())
            else:
                say(f"gyre compare: {a}, run {i + 1} of {repeats}")
                m = run(c.with_policy(c.run.policy, str(d)), say=say)
            measured.setdefault(a, []).append(m)
    result = predicted(cfg, configs, measured, repeats)
    root.mkdir(parents=True, exist_ok=True)
    write_json(root / "compare.json", result)
    say(table(result["rows"]))
    for k, v in result["ratios"].items():
        say(f"{k}: {v:.3f}")
    say(f"calibration (measured medians fed to the simulator): {result['calibration']}")
    say(f"written: {root / 'compare.json'}")
    return result
