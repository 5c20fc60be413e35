"""Workload configuration for the simulator: plain TOML or JSON, loaded into frozen dataclasses.

Every section and key is checked (gyre-base's `gyre_base.tables.dataclass_from_table`): an unknown key, a wrong type
or an out-of-range value is a `ConfigError` naming it. `sample_durations` draws every execution's nominal
duration for a run from the configured distributions with one seeded generator, so all policies can be
run on the same sample.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, get_type_hints

import numpy as np
from gyre_base.tables import ConfigError as ConfigError  # defined there, raised from here too
from gyre_base.tables import dataclass_from_table

from gyre_sched.policy import WaterLevelConfig
from gyre_sched.predict import PredictConfig


@dataclass(frozen=True, slots=True)
class RunConfig:
    steps: int = 48
    """Optimizer steps in the run."""
    cells: int = 4
    """Equal cells; cell 0 is the core."""
    seed: int = 0
    timeout_h: float = 6.0
    """Hard timeout of one execution."""
    timeout_counts_pauses: bool = False
    """Whether the timeout clock runs while no cell serves rollout at all (Colocate's training phase, when
    every agent is frozen waiting for the model). False: it stops, as a frozen harness does not age."""


@dataclass(frozen=True, slots=True)
class BatchConfig:
    queries: int = 16
    """Queries (groups) per optimizer step."""
    group_size: int = 8
    """Executions per query."""


@dataclass(frozen=True, slots=True)
class DurationConfig:
    kind: str = "lognormal"
    """Distribution of a query's duration scale: lognormal | uniform | exponential."""
    median_h: float = 4.0
    """lognormal: median of the query scale (hours)."""
    sigma: float = 0.6
    """lognormal: log-space standard deviation of the query scale."""
    low_h: float = 0.5
    """uniform: lowest query scale."""
    high_h: float = 8.0
    """uniform: highest query scale."""
    mean_h: float = 3.0
    """exponential: mean query scale."""
    exec_sigma: float = 0.3
    """Each execution = query scale x lognormal(0, exec_sigma): spread inside a group."""
    model_fraction: float = 0.5
    """Share of an execution's time spent in model calls (the rest is tool time, which needs no GPU)."""


@dataclass(frozen=True, slots=True)
class CellConfig:
    rollout_capacity: int = 64
    """Concurrent executions one rollout cell serves at full speed; beyond it model calls queue."""
    train_group_s: float = 600.0
    """Cell-seconds to train one group on one cell (forward + backward of its trajectories)."""
    train_group_s_by_cells: tuple[float, ...] = ()
    """Cell-seconds per group with 1, 2, ... cells training at once (item k-1 for k cells; past the last
    item, the last), replacing `train_group_s` where given. Training does not scale linearly with cells:
    data-parallel ranks wait for each other, and cells that share a GPU share its time. Two cells on one
    H200 trained a step in 46 cell-seconds side by side and in 37 for one training beside the other
    serving (`gyre compare` measures these; empty: `train_group_s` at any count)."""
    update_s: float = 120.0
    """Optimizer step plus pushing the new weights to rollout engines."""
    to_training_s: float = 8.52
    """Rollout -> training switch (report, 122B: 8.52 s)."""
    to_rollout_s: float = 3.46
    """Training -> rollout switch (report, 122B: 3.46 s)."""

    def group_s(self, training_cells: int) -> float:
        """Cell-seconds to train one group while `training_cells` cells train at once."""
        by = self.train_group_s_by_cells
        return by[min(max(training_cells, 1), len(by)) - 1] if by else self.train_group_s


@dataclass(frozen=True, slots=True)
class DriverConfig:
    max_ahead: int = 2
    """Batches rollout may run ahead of the trainer: batch b starts once version >= b - max_ahead."""
    staleness_target: float = 1.5
    """Mean policy-version lag E[d] not to exceed: no new batch starts while the measured mean is above."""
    streaming: bool = True
    """Train a step's groups as they become ready instead of waiting for its whole batch."""
    decision_interval_s: float = 10.0
    """The policy is also asked this often (besides after every event), so hold timers expire on time."""


@dataclass(frozen=True, slots=True)
class AsyncConfig:
    train_cells: int = 1
    """Async baseline's fixed number of training cells (the report does not give its split)."""


@dataclass(frozen=True, slots=True)
class Workload:
    name: str = "custom"
    run: RunConfig = field(default_factory=RunConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    durations: DurationConfig = field(default_factory=DurationConfig)
    cell: CellConfig = field(default_factory=CellConfig)
    driver: DriverConfig = field(default_factory=DriverConfig)
    elastic: WaterLevelConfig = field(default_factory=WaterLevelConfig)
    async_: AsyncConfig = field(default_factory=AsyncConfig)
    predict: PredictConfig = field(default_factory=PredictConfig)

    def __post_init__(self) -> None:
        _check(self.run.steps >= 1, "run.steps must be >= 1")
        _check(self.run.cells >= 1, "run.cells must be >= 1")
        _check(self.run.timeout_h > 0, "run.timeout_h must be > 0")
        _check(self.batch.queries >= 1 and self.batch.group_size >= 1, "batch sizes must be >= 1")
        _check(self.durations.kind in ("lognormal", "uniform", "exponential"), "durations.kind unknown")
        _check(0.0 < self.durations.model_fraction <= 1.0, "durations.model_fraction must be in (0, 1]")
        _check(self.cell.rollout_capacity >= 1, "cell.rollout_capacity must be >= 1")
        _check(self.cell.train_group_s > 0, "cell.train_group_s must be > 0")
        _check(
            all(g > 0 for g in self.cell.train_group_s_by_cells), "cell.train_group_s_by_cells must be > 0"
        )
        _check(
            min(self.cell.update_s, self.cell.to_training_s, self.cell.to_rollout_s) >= 0, "cell times >= 0"
        )
        _check(self.driver.max_ahead >= 0, "driver.max_ahead must be >= 0")
        _check(self.driver.decision_interval_s > 0, "driver.decision_interval_s must be > 0")
        _check(
            1 <= self.async_.train_cells < max(2, self.run.cells), "async.train_cells must be in [1, cells)"
        )

    @property
    def timeout_s(self) -> float:
        return self.run.timeout_h * 3600.0


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


_SECTIONS = {f.name.rstrip("_"): f.name for f in dataclasses.fields(Workload) if f.name != "name"}
"""Section name in a file -> field of `Workload` (`async` is `async_`)."""
_SECTION_TYPES = get_type_hints(Workload)


def workload_from_dict(raw: dict[str, Any]) -> Workload:
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key == "name":
            kwargs["name"] = str(value)
        elif key in _SECTIONS:
            name = _SECTIONS[key]
            kwargs[name] = dataclass_from_table(_SECTION_TYPES[name], key, value)
        else:
            raise ConfigError(f"unknown section [{key}]; known: {', '.join(sorted(_SECTIONS))}")
    return Workload(**kwargs)


def load_workload(path: str | Path) -> Workload:
    """Load a workload from a .toml or .json file, or a preset name such as `2p4t`."""
    p = Path(path)
    if not p.exists() and p.suffix == "":
        preset = resources.files("gyre_sched.presets") / f"{p.name}.toml"
        if preset.is_file():
            return workload_from_dict(tomllib.loads(preset.read_text()))
        raise ConfigError(f"no file or preset named {str(path)!r}")
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {p}: {exc}") from exc
    try:
        raw = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{p}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: top level must be a table")
    return workload_from_dict(raw)


def sample_durations(w: Workload, rng: np.random.Generator | None = None) -> np.ndarray:
    """Nominal durations in seconds, shape (steps, queries, group_size): the time each execution takes
    at full service. Wall durations come out of the simulation (slowdowns, the hard timeout)."""
    rng = rng or np.random.default_rng(w.run.seed)
    d = w.durations
    shape = (w.run.steps, w.batch.queries)
    if d.kind == "lognormal":
        scale = d.median_h * np.exp(d.sigma * rng.standard_normal(shape))
    elif d.kind == "uniform":
        scale = rng.uniform(d.low_h, d.high_h, shape)
    else:
        scale = rng.exponential(d.mean_h, shape)
    noise = np.exp(d.exec_sigma * rng.standard_normal((*shape, w.batch.group_size)))
    out: np.ndarray = scale[..., None] * noise * 3600.0
    return out


def query_profile(
    durations_s: np.ndarray, timeout_s: float, over_s: float = 4 * 3600.0
) -> tuple[float, float]:
    """(share of queries whose longest execution runs over `over_s`, share of those that end at the
    timeout), the two numbers the report gives for its 2.4T workload."""
    longest = np.minimum(durations_s.max(axis=-1), timeout_s).ravel()
    over = longest > over_s
    n_over = int(over.sum())
    at_to = int((longest[over] >= timeout_s).sum())
    return n_over / max(1, longest.size), at_to / max(1, n_over)
