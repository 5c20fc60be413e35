"""Parts that ride along a `gyre run`: started once the system is up, ticked by the run's main loop, and
waited for before the run ends (the held-out evaluator, the demo's per-step report).

A part sees the running system through `RunContext` (the proxy's address, the rollout driver, the
trajectory service, the sampler and the core's weight publisher) and uses only their public methods. A
part that raises from `tick` fails the run, naming it. When the run goes on in a new attempt
(supervise.py), a part with a true `restartable` attribute is started again with the new attempt's
context (after its `stop`); any other part ends the run instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from gyre.config.runconfig import Config
    from gyre.measure.metrics import Sampler
    from gyre.rollout.driver import Driver
    from gyre.trajsvc.service import TrajectoryService


@dataclass(frozen=True)
class RunContext:
    cfg: Config
    out: Path
    proxy_url: str
    driver: Driver
    traj: TrajectoryService
    sampler: Sampler
    publisher: str
    """The core's gyre-xfer publisher (weight snapshots, shared memory)."""


class RunPart(Protocol):
    name: str

    def start(self, ctx: RunContext) -> None:
        """Called once, before the driver starts the first batch."""
        ...

    def tick(self, ctx: RunContext) -> None:
        """Called every 0.1 s from the run's main loop; raise to fail the run."""
        ...

    def done(self) -> bool:
        """The run may end (once its steps are applied) only when every part is done."""
        ...

    def stop(self) -> None:
        """Called once at the end, also after an error."""
        ...
