"""Supervision of a run's parts: what dies is restarted, with a budget and a backoff, and the run goes on.

`gyre run` hands each child process it starts to a `Supervisor` with the way to start it again
(`watch`); the run's main loop calls `check` instead of failing on the first dead child. Per part:

- **a satellite cell** (cell i > 0: its gyre-engine and its gyre-train satellite), dead or killed (its
  engine dying ends it too), or marked failed by gyre-sched while its process is stopped or stuck (the
  process is killed, then handled as dead): its old engine is killed if it still lives (`pids.txt`), and
  the cell is started again with the same settings: same engine port, so the proxy gets the same
  endpoint back when gyre-sched re-adds it. The new cell loads the core's current version before it
  registers, and asks gyre-sched again until the old registration is failed (`failure_timeout_s`). The
  core re-queues the micro-batches the dead satellite had claimed (gyre-train's claim queue).
- **the proxy**: its log's torn tail (a frame cut by the kill) is set aside, it is started on the same
  port with the same log, and every record of the log since this attempt began is replayed into the
  trajectory service (each call once, by call id), so a record that was fsynced but never pushed is
  still trained. Calls in flight fail; the harness retries them (agent.py) within the execution timeout.
- **anything else** (the core cell, gyre-sched, the trajectory service, the rollout driver, a part the
  scheduler fails that is the core): not restarted in place. These hold the run's live state (the
  core's open steps, the scheduler's cell table and every peer's registration, the driver's running
  executions) and have no protocol to take it over. `RestartAttempt` is raised instead: `gyre run` stops
  every process and starts the next attempt of the run in the same directory, exactly as
  `gyre run --resume` would (resume.py: from the core's checkpoint; steps not applied are run again).

A part that exits with `procs.nospace.EXIT_DISK_FULL` (it could not write for want of space) is neither
restarted nor given a new attempt: `OutOfSpace` is raised, and `gyre run` stops once (diskfull.py).

Every restart is counted against `max_restarts` per part (and per run for attempts), after a wait of
`backoff_s x 2^(n-1)` (at most 30 s); past the budget the run fails with `ChildDied`/`RunError` as without
supervision. `[survive] restart = false` keeps the old fail-fast behaviour. Each restart is an `Event`
(what, when it was seen dead, when it was started again, when it was back up), for the chaos report.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gyre.procs.group import ChildDied, ProcessGroup, tail
from gyre.procs.nospace import EXIT_DISK_FULL, OutOfSpace

BACKOFF_CAP_S = 30.0


class RestartAttempt(RuntimeError):
    """A part that cannot be restarted in place failed: the run's next attempt must start."""


@dataclass
class Event:
    part: str
    why: str
    seen_at: float
    restarted_at: float | None = None
    up_at: float | None = None
    """When the restarted part was back (its `ready` check passed); None: not yet."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Watch:
    restart: Callable[[], None]
    ready: Callable[[], bool]
    due: float | None = None
    """When a restart is due (the backoff after the part was seen dead); None: not pending."""
    open_event: Event | None = None


@dataclass
class Supervisor:
    procs: ProcessGroup
    max_restarts: int
    backoff_s: float
    say: Callable[[str], None] = print
    restart: bool = True
    events: list[Event] = field(default_factory=list)
    attempts: bool | None = None
    """A failed part not restarted in place gives way to a new attempt (`RestartAttempt`) rather than an
    error; None: as `restart` (parts placed by Ray are not restarted in place, yet a new attempt places
    them again)."""
    restarts: Counter[str] = field(default_factory=Counter)
    _watches: dict[str, _Watch] = field(default_factory=dict)

    def new_attempts(self) -> bool:
        """Whether a part that cannot be restarted in place gives way to a new attempt."""
        return self.restart if self.attempts is None else self.attempts

    def watch(self, part: str, restart: Callable[[], None], ready: Callable[[], bool]) -> None:
        """`part` (a child process of that name) is restarted by `restart`; it is back when `ready`."""
        self._watches[part] = _Watch(restart, ready)

    def check(self) -> None:
        """Restart dead watched parts whose backoff is over; note parts that are back; raise for a dead
        part that is not watched (RestartAttempt when supervising, ChildDied otherwise) or over budget."""
        now = time.monotonic()
        for child in self.procs.dead():
            rc = child.proc.returncode
            why = f"{child.name} exited with code {rc}"
            w = self._watches.get(child.name)
            if rc == EXIT_DISK_FULL:  # no restart or new attempt writes on that disk either
                raise OutOfSpace(f"{child.name} could not write for want of space; {tail(child.log, 1)}")
            if not self.restart:
                raise ChildDied(f"{why}; last lines of {child.log}:\n{tail(child.log)}", rc)
            if w is None:
                raise RestartAttempt(f"{why} (not restartable in place); last lines:\n{tail(child.log, 12)}")
            n = self.restarts[child.name] + 1
            if n > self.max_restarts:
                raise ChildDied(
                    f"{why} after {self.max_restarts} restarts ([survive] max_restarts); last lines of "
                    f"{child.log}:\n{tail(child.log)}",
                    rc,
                )
            self.procs.forget(child)
            w.due = now + min(BACKOFF_CAP_S, self.backoff_s * 2 ** (n - 1))
            w.open_event = Event(child.name, why, time.time())
            self.events.append(w.open_event)
            self.say(f"gyre run: {why}; restart {n} of {self.max_restarts} in {w.due - now:.1f} s")
        for part, w in self._watches.items():
            if w.due is not None and now >= w.due:
                w.due = None
                self.restarts[part] += 1
                w.restart()
                if w.open_event is not None:
                    w.open_event.restarted_at = time.time()
            ev = w.open_event
            if ev is not None and ev.restarted_at is not None and ev.up_at is None and w.ready():
                ev.up_at = time.time()
                w.open_event = None
                self.say(f"gyre run: {part} is back ({ev.up_at - ev.seen_at:.1f} s after it was seen dead)")

    def pending(self) -> bool:
        """A restart is waiting or a restarted part is not back yet."""
        return any(w.open_event is not None for w in self._watches.values())

    def restarting(self, part: str) -> bool:
        """`part` died and is waiting for its restart, or is restarted and not back yet."""
        w = self._watches.get(part)
        return w is not None and w.open_event is not None

    def kill(self, part: str, why: str) -> bool:
        """SIGKILL the live child `part` (stopped or stuck; the next `check` restarts it); False if it
        is not a watched, live child."""
        if part not in self._watches:
            return False
        for c in self.procs.children:
            if c.name == part and c.proc.poll() is None:
                self.say(f"gyre run: {part} {why}; killing it to restart it")
                with contextlib.suppress(ProcessLookupError):
                    c.proc.kill()
                c.proc.wait(10.0)
                return True
        return False


def kill_leftover(log_dir: Path, name: str) -> None:
    """SIGKILL the newest process named `name` in the run's `pids.txt` if it still lives (a dead cell's
    engine that has not yet exited on its parent-death signal, holding its port)."""
    p = log_dir / "pids.txt"
    if not p.exists():
        return
    pids = [int(line.split()[0]) for line in p.read_text().splitlines() if line.split()[1:] == [name]]
    if not pids:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pids[-1], signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            try:
                os.kill(pids[-1], 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)
