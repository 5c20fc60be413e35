"""`gyre run CONFIG`: the whole system, until the last step lands: as local processes on this machine, or
placed on a Ray cluster with `[run] ray_address` (`launch.py`: where each part starts and which address it
binds).

The run directory is claimed first (`rundir.RunDir`: an exclusive lock, a finished run refused and kept,
an unfinished one continued only by `resume=True` (with the configuration it was started with, but placed on
Ray as `cfg` says: `--ray`, `--ray-resources`, as after a lost node) unless it never reached its first step, nothing
deleted). Then the run goes in attempts (`attempt.py`: build, start, watch, collect): the first, and after a
part that cannot be restarted in place failed (`supervise.RestartAttempt`), a new one that continues the
run from the core's checkpoint, up to `[survive] max_restarts` (none while a part that rides along cannot
start again). A full disk under the run directory stops the run once, as `diskfull.DiskFull` (no new
attempt). What each step trained goes to the ledger (`trajsvc/ledger.py`), and `metrics.json` carries its
`accounting` of the records. The state file says `finished` or `failed` at the end; the run's shared
memory is swept.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gyre.config.runconfig import Config, config_from_dict
from gyre.procs.nospace import is_full
from gyre.rollout.harnesses import check_harness, check_tasks
from gyre.system import diskfull
from gyre.system.attempt import Lost, RunError, attempt
from gyre.system.rundir import NothingToResume, RunDir, read_state, sweep_segments
from gyre.system.runparts import RunPart
from gyre.system.supervise import Event, RestartAttempt

log = logging.getLogger("gyre.run")


def resume_config(out: Path) -> Config:
    """The configuration of the run in `out` (for `gyre run --resume`), its out_dir set to `out`."""
    st = read_state(out)
    if st is None:
        raise NothingToResume(f"{out} holds no run to resume (no run.json)")
    return _located(st["config"], out)


def _located(raw: dict[str, Any], out: Path) -> Config:
    """The configuration a run was started with (`run.json`), its out_dir where the run now is."""
    cfg = config_from_dict(raw)
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, out_dir=str(out)))


def run(
    cfg: Config, say: Callable[[str], None] = print, parts: Sequence[RunPart] = (), *, resume: bool = False
) -> dict[str, Any]:
    """Run the system for `cfg`; returns the metrics (also written to out_dir/metrics.json). `parts` ride
    along (`runparts.py`); with `[eval] tasks`, the held-out evaluator is one of them. `resume`: continue
    the unfinished run in out_dir (RunDirError subclasses say why a directory is refused). A harness
    that cannot run here, or `[tasks]` rows or a reward that cannot be used, is a `ConfigError` before
    anything is claimed or started."""
    check_harness(cfg.agent)
    check_tasks(cfg)
    out = Path(cfg.run.out_dir).resolve()
    rd = RunDir.claim(out, cfg.to_dict(), resume=resume)
    if resume:  # the run goes on as it was configured, placed where `cfg` says (a node may be gone)
        placed = _located(rd.config, out)
        cfg = dataclasses.replace(
            placed,
            run=dataclasses.replace(
                placed.run, ray_address=cfg.run.ray_address, ray_resources=cfg.run.ray_resources
            ),
        )
    if rd.restarted is not None:
        was = rd.restarted
        say(
            f"gyre run: {out} held a run that never reached its first step ({was['state']}"
            + (f": {was['why'].splitlines()[0]}" if was.get("why") else "")
            + f"); it starts again with this configuration, as attempt {rd.attempt}"
        )
    events: list[Event] = []
    losses: list[Lost] = []  # parts lost on Ray, over every attempt
    restarted = 0
    model_dir = Path(cfg.run.model_dir) if cfg.run.model_dir else out / "model"
    try:
        while True:
            if rd.attempt:  # a resumed or new attempt on a disk still full stops before anything starts
                diskfull.check_room(out, model_dir)
            try:
                metrics = attempt(cfg, rd, say, parts, events, losses)
                break
            except RestartAttempt as exc:
                full = diskfull.stopped(out, exc, model_dir)
                if full is not None:  # every new attempt would meet the same disk
                    raise full from exc
                restarted += 1
                fixed = [p.name for p in parts if not getattr(p, "restartable", False)]
                fixed += ["the held-out evaluator"] if cfg.eval.tasks else []
                if fixed or restarted > cfg.survive.max_restarts:
                    why = f"{', '.join(fixed)} cannot start again" if fixed else "[survive] max_restarts"
                    raise RunError(f"{exc}; no new attempt ({why})") from exc
                events.append(Event("attempt", str(exc).splitlines()[0], time.time(), time.time()))
                say(new_attempt_message(exc, rd.attempt + 1))
                rd.next_attempt()
    except BaseException as exc:
        full = diskfull.stopped(out, exc, model_dir) if is_full(exc) else None
        failed = full or exc
        try:
            rd.mark("failed", f"{type(failed).__name__}: {failed}")
        except OSError as mark_exc:  # the state file stays `running`: --resume continues that too
            log.warning("the run's state file could not be written: %s", mark_exc)
        if full is not None and full is not exc:
            raise full from exc
        raise
    finally:
        sweep_segments(out / "logs")
        rd.release()
    return metrics


def new_attempt_message(exc: BaseException, attempt: int) -> str:
    """What `gyre run` says when attempt `attempt` starts after `exc`: its first line, then the rest (the
    failed part's last log lines, which say why it died) indented below."""
    first, *rest = str(exc).splitlines() or [""]
    said = "".join(f"\n    {line}" for line in rest)
    return f"gyre run: {first}; attempt {attempt} continues the run{said}"
