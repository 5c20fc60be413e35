"""`gyre chaos CONFIG`: a run under injected faults, and a JSON report of what it survived.

The run is `gyre run` with restarts on (`[survive] restart = true`, gyre-sched's `failure_timeout_s` at
`failure_timeout_s` so that a dead cell is noticed soon); this process injects faults into its real
processes, found by name in the run's `logs/pids.txt`, one at a time: once the run's rollout has
started, it waits a random 0.5-3 s, injects the next fault, waits until the run has recovered from it,
and goes on until `faults` are injected or the run ends. The kinds (each is drawn once before any is
drawn again):

- `kill-proxy`, `kill-satellite` (cell 1), `kill-engine` (cell 1's gyre-engine; its cell ends with it):
  SIGKILL, restarted in place (supervise.py);
- `kill-core` (cell 0: the trainer core and its engine), `kill-sched` (gyre-sched): SIGKILL, the run
  goes on in a new attempt from the core's checkpoint;
- `stop-proxy`, `stop-satellite`, `stop-engine` (cell 1's), `stop-sched`: SIGSTOP for 1-4 s, then
  SIGCONT (shorter than the scheduler's failure timeout: a stall, not a death);
- `hang-transfer-peer`: SIGSTOP of the core cell for 1-4 s: the gyre-xfer weight publisher every engine
  pulls from, and the peer a satellite's gradient is read into;
- `disk-full`: the proxy's record log stops growing (RLIMIT_FSIZE set on the live proxy to the log's size,
  with `prlimit`; every write fails with EFBIG, as on a full disk) for 2-5 s, then the limit is lifted.

Recovered: the part runs again (the same process after a stop; after a kill a new one that serves: a
satellite cell welcomed by gyre-sched again, the proxy answering /health, or a new attempt of the run
for the core cell and gyre-sched) and then the run makes progress (the trajectory service receives a
record or the core applies a step), or has nothing left to run; `time_to_recover_s` is from the
injection to then. The run's records are checked against its ledger (`ledger.account`); an
execution's lost or twice-trained records are charged to the fault kinds whose window (injection to
recovery) overlaps its calls. The report goes to `<out>/chaos.json`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import resource
import signal
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre.config.runconfig import Config
from gyre.system.attempt import proxy_up
from gyre.system.resume import checkpoint_position
from gyre.system.run import run
from gyre.system.runparts import RunContext
from gyre.trajsvc import ledger, recordlog

KILL = {"kill-proxy": "proxy", "kill-satellite": "cell-1", "kill-engine": "engine-1",
        "kill-core": "cell-0", "kill-sched": "sched"}  # fmt: skip
STOP = {"stop-proxy": "proxy", "stop-satellite": "cell-1", "stop-engine": "engine-1",
        "stop-sched": "sched", "hang-transfer-peer": "cell-0"}  # fmt: skip
KINDS = (*KILL, *STOP, "disk-full")
RECOVER_TIMEOUT_S = 900.0


@dataclass
class Injection:
    kind: str
    part: str
    pid: int
    at: float
    hold_s: float = 0.0
    back_at: float | None = None
    """The part running again (the wall clock), None: never."""
    recovered_at: float | None = None
    cell_up: str = ""
    """Cell 1's `cells/1.up` (the pid gyre-sched welcomed) at the injection."""


def chaos_config(cfg: Config, out: str, failure_timeout_s: float) -> Config:
    return dataclasses.replace(
        cfg,
        run=dataclasses.replace(cfg.run, out_dir=out),
        sched=dataclasses.replace(cfg.sched, failure_timeout_s=failure_timeout_s),
        survive=dataclasses.replace(
            cfg.survive, restart=True, max_restarts=max(cfg.survive.max_restarts, 50)
        ),
    )


def newest_pid(log_dir: Path, name: str) -> int | None:
    """The newest live process named `name` in the run's `pids.txt`."""
    p = log_dir / "pids.txt"
    if not p.exists():
        return None
    pids = [int(ln.split()[0]) for ln in p.read_text().splitlines() if ln.split()[1:] == [name]]
    if not pids:
        return None
    try:
        os.kill(pids[-1], 0)
    except ProcessLookupError:
        return None
    return pids[-1]


class Injector:
    """A part that rides along the run (`runparts.RunPart`, started again in each new attempt): it injects
    the faults from its own thread, and the run does not end before they are all injected."""

    name = "chaos"
    restartable = True

    def __init__(self, out: Path, faults: int, seed: int, kinds: tuple[str, ...], say: Callable[[str], None]):
        self.out = out
        self.logs = out / "logs"
        self.faults = faults
        self.rng = random.Random(seed)
        self.kinds = kinds
        self.say = say
        self.done_ = threading.Event()
        self.rolling = threading.Event()
        self.injections: list[Injection] = []
        self.ctx: RunContext | None = None
        self.error: BaseException | None = None
        self._bag: list[str] = []
        self._thread = threading.Thread(target=self._main, name="chaos", daemon=True)

    # ---- RunPart ------------------------------------------------------------------------------------
    def start(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.rolling.set()
        if self._thread.ident is None:
            self._thread.start()

    def tick(self, ctx: RunContext) -> None:
        if self.error is not None:
            raise RuntimeError(f"the fault injector failed: {self.error}") from self.error

    def done(self) -> bool:
        return self.done_.is_set()

    def stop(self) -> None:
        self.rolling.clear()  # this attempt ends; a new one starts it again

    def close(self) -> None:
        self.done_.set()
        if self._thread.ident is not None:
            self._thread.join(30.0)

    # ---- the injector thread ------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.run()
        except BaseException as exc:
            self.error = exc
        finally:
            self.done_.set()

    def _progress(self) -> tuple[int, int, bool]:
        """Records received and steps applied by the trajectory service of the current attempt, and
        whether its driver has run every batch."""
        c = self.ctx
        if c is None or not self.rolling.is_set():
            return (-1, -1, False)
        return (c.traj.records, c.traj.applied, c.driver.done.is_set())

    def _next_kind(self) -> str:
        if not self._bag:
            self._bag = list(self.kinds)
            self.rng.shuffle(self._bag)
        return self._bag.pop()

    def _log_size(self) -> int:
        p = self.out / "records.msgpack"
        return p.stat().st_size if p.exists() else 0

    def run(self) -> None:
        while len(self.injections) < self.faults:
            if not self.rolling.wait(1.0):
                continue
            time.sleep(self.rng.uniform(0.5, 3.0))
            kind = self._next_kind()
            inj = self._inject(kind)
            if inj is None:
                self._bag.append(kind)  # its process is not up right now: later
                time.sleep(1.0)
                continue
            self.injections.append(inj)
            self.say(
                f"gyre chaos: fault {len(self.injections)}/{self.faults}: {kind} ({inj.part}, pid {inj.pid})"
            )
            self._await_recovery(inj)

    def _inject(self, kind: str) -> Injection | None:
        part = KILL.get(kind) or STOP.get(kind) or "proxy"
        pid = newest_pid(self.logs, part)
        if pid is None:
            return None
        up = self.out / "cells" / "1.up"
        inj = Injection(kind, part, pid, time.time(), cell_up=up.read_text() if up.exists() else "")
        with contextlib.suppress(ProcessLookupError):
            if kind in KILL:
                os.kill(pid, signal.SIGKILL)
                if part in ("cell-0", "sched"):
                    self.rolling.clear()  # a new attempt of the run: wait for its rollout to start
            elif kind in STOP:
                inj.hold_s = self.rng.uniform(1.0, 4.0)
                os.kill(pid, signal.SIGSTOP)
                time.sleep(inj.hold_s)
                os.kill(pid, signal.SIGCONT)
            else:  # disk-full
                inj.hold_s = self.rng.uniform(2.0, 5.0)
                soft, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
                resource.prlimit(pid, resource.RLIMIT_FSIZE, (self._log_size(), hard))  # the soft limit:
                time.sleep(inj.hold_s)  # a hard one lowered cannot be raised again without privileges
                resource.prlimit(pid, resource.RLIMIT_FSIZE, (soft, hard))
        return inj

    def _back(self, inj: Injection) -> bool:
        """The faulted part runs again: the same process after a stop; after a kill, a new one that is
        serving (a satellite cell welcomed by gyre-sched again, the proxy answering /health; the core
        cell and gyre-sched come back in a new attempt, whose progress `_await_recovery` waits for)."""
        pid = newest_pid(self.logs, inj.part)
        if inj.kind not in KILL:
            return pid is not None
        if pid is None or pid == inj.pid:
            return False
        if inj.part in ("cell-1", "engine-1"):
            up = self.out / "cells" / "1.up"
            return up.exists() and up.read_text() != inj.cell_up
        if inj.part == "proxy":
            return self.ctx is not None and proxy_up(self.ctx.proxy_url)
        return True

    def _await_recovery(self, inj: Injection) -> None:
        """Wait until the part runs again, then until the run makes progress (a record arrives or a step
        is applied, in this attempt or the next), or has nothing left to do."""
        deadline = time.monotonic() + RECOVER_TIMEOUT_S
        while inj.back_at is None:
            if self._back(inj):
                inj.back_at = time.time()
            elif time.monotonic() > deadline:
                return
            else:
                time.sleep(0.1)
        before: tuple[int, int, bool] | None = None
        while time.monotonic() < deadline:
            now = self._progress()
            if now[0] < 0:  # between attempts: compare within the next one
                before = None
            elif now[2] or (before is not None and now[:2] != before[:2]):
                inj.recovered_at = time.time()
                return
            elif before is None:
                before = now
            time.sleep(0.05)


def chaos(
    cfg: Config,
    faults: int,
    seed: int,
    out: Path,
    kinds: tuple[str, ...] = KINDS,
    failure_timeout_s: float = 8.0,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run `cfg` under `faults` injected faults; returns the report (also `out/chaos.json`)."""
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
    out = out.resolve()
    cfg = chaos_config(cfg, str(out), failure_timeout_s)
    inj = Injector(out, faults, seed, kinds, say)
    t0 = time.time()
    error = ""
    metrics: dict[str, Any] = {}
    try:
        metrics = run(cfg, say=say, parts=[inj])
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        say(f"gyre chaos: the run failed: {error}")
    finally:
        end = time.time()
        inj.close()
    applied = metrics.get("steps_applied", checkpoint_position(out)[0])
    acc = ledger.account(out, applied)
    report = _report(cfg, inj, acc, metrics, error, end - t0, out)
    (out / "chaos.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def _windows(inj: list[Injection]) -> list[tuple[str, float, float]]:
    return [(i.kind, i.at, i.recovered_at or float("inf")) for i in inj]


def _charge(
    counts: dict[str, int], spans: dict[str, tuple[float, float]], windows: list[tuple[str, float, float]]
) -> dict[str, int]:
    """Records of each execution charged to the first fault whose window overlaps its calls."""
    by_kind: dict[str, int] = {}
    for e, n in counts.items():
        a, b = spans.get(e, (0.0, 0.0))
        kind = next((k for k, w0, w1 in windows if a <= w1 and b >= w0), "none")
        by_kind[kind] = by_kind.get(kind, 0) + n
    return by_kind


def _report(
    cfg: Config,
    inj: Injector,
    acc: ledger.Accounting,
    metrics: dict[str, Any],
    error: str,
    wall_s: float,
    out: Path,
) -> dict[str, Any]:
    spans: dict[str, tuple[float, float]] = {}
    for _, c in recordlog.calls(out / "records.msgpack"):
        a, b = spans.get(c.execution_id, (c.t_start, c.t_end))
        spans[c.execution_id] = (min(a, c.t_start), max(b, c.t_end))
    windows = _windows(inj.injections)
    lost = _charge(acc.lost, spans, windows)
    twice = _charge(acc.twice, spans, windows)
    by_kind: dict[str, Any] = {}
    for kind in sorted({i.kind for i in inj.injections}):
        mine = [i for i in inj.injections if i.kind == kind]
        ttr = [i.recovered_at - i.at for i in mine if i.recovered_at is not None]
        by_kind[kind] = {
            "injections": len(mine),
            "recovered": len(ttr),
            "records_lost": lost.get(kind, 0),
            "records_trained_twice": twice.get(kind, 0),
            "time_to_recover_s": {
                "median": round(statistics.median(ttr), 2) if ttr else None,
                "max": round(max(ttr), 2) if ttr else None,
            },
        }
    acc_d = {k: v for k, v in acc.to_dict().items() if k not in ("lost", "twice")}
    return {
        "config": {"steps": cfg.run.steps, "cells": cfg.run.cells, "seed": cfg.run.seed},
        "finished": not error,
        "error": error,
        "wall_s": round(wall_s, 1),
        "steps_applied": metrics.get("steps_applied"),
        "attempts": (metrics.get("attempt") or 0) + 1 if metrics else None,
        "injections": len(inj.injections),
        "recovered": sum(i.recovered_at is not None for i in inj.injections),
        "records_lost": acc.records_lost,
        "records_trained_twice": acc.records_trained_twice,
        "by_kind": by_kind,
        "not_charged_to_a_fault": {
            "records_lost": lost.get("none", 0),
            "records_trained_twice": twice.get("none", 0),
        },
        "accounting": acc_d,
        "faults": [dataclasses.asdict(i) for i in inj.injections],
        "restarts": metrics.get("survival", {}).get("events", []),
    }
