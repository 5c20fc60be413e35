"""What the sampler of a run records every interval, and what one sample says about the engines.

A `Sample` is one reading of the running system: every cell's role (gyre-sched's `State`), whether its
engine ran or queued a request, and the weight version it serves. `engines_serve` reads the newest sample:
no cell mid-switch, and every rollout cell's engine at a weight version (what the run waits for at its end,
and what the held-out evaluation waits for before it starts).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from gyre_sched.protocol import Role


@dataclass
class Sample:
    t: float
    roles: dict[int, int]
    engine_busy: dict[int, bool]
    """The engine ran or queued a request at this sample, or computed anything since the last one."""
    engine_version: dict[int, str]
    engine_counters: dict[int, dict[str, float | None]] = field(default_factory=dict)
    """Each engine's cumulative work (gyre-engine's `EngineCounters` as a dict) and its `waiting`
    requests, where it reported them: what `efficiency.engine_time` reads how it spent its time from."""


def busy_between(prev: Sample, cur: Sample, cid: int) -> bool:
    """Whether cell `cid`'s engine counts as busy over the interval from `prev` to `cur`: busy at either
    end (each sample's flag already says whether it computed since the one before)."""
    return cur.engine_busy.get(cid, False) or prev.engine_busy.get(cid, False)


def at_least(v: str | None, version: int) -> bool:
    """An engine's reported weight version (a string, as engines report it) is `version` or newer."""
    return v is not None and v.isdigit() and int(v) >= version


def engines_serve(samples: Sequence[Sample], version: int, gone: Collection[int] = ()) -> bool:
    """No cell mid-switch, and every rollout cell's engine serves `version` or newer (the newest sample);
    cells in `gone` (lost, the run went on without them) are left out."""
    if not samples:
        return False
    last = samples[-1]
    roles = {cid: r for cid, r in last.roles.items() if int(cid) not in gone}
    if any(r not in (int(Role.ROLLOUT), int(Role.TRAINING)) for r in roles.values()):
        return False
    rollout = [cid for cid, r in roles.items() if r == int(Role.ROLLOUT)]
    return bool(rollout) and all(at_least(last.engine_version.get(cid), version) for cid in rollout)
