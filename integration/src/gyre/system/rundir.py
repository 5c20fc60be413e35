"""A run directory's ownership: one live `gyre run` per directory, and a finished run kept as it is.

`RunDir.claim(out, resume=...)` takes an exclusive `flock` on `out/run.lock` for the life of the run
(the kernel drops it when the process dies, `kill -9` included, so a dead run never blocks the next).
It reads `out/run.json`, the run's state file, and decides:

- no `run.json`: a fresh run (attempt 0). Nothing in the directory is deleted (a model made by an
  earlier run, a demo's tensorboard files stay).
- `run.json` says `finished`: refused (`RunFinished`); its records, checkpoint and metrics are kept. A new
  run needs a new directory.
- `run.json` says `running` or `failed` (killed, or ended by an error): refused without `--resume`
  (`RunUnfinished`, naming `gyre run --resume DIR`); with it, the next attempt continues the run.
  Except a run that never reached its first step (no line in the core's `steps.jsonl`: it failed at
  start, a bad `model_dir` say): a new run there is its next attempt with the new configuration
  (`restarted` says what the old one was), so a corrected config starts it again.
- `--resume` of a directory with no `run.json`: refused (`NothingToResume`).
- the lock held by a live run: refused (`RunBusy`), whatever the state file says.

Every child process of the run (and the cells' children) is listed in `logs/pids.txt` by
`procs.ProcessGroup`; `sweep_segments` removes gyre-xfer shared-memory segments (`/dev/shm/gyre-<pid>-*`)
of those processes once they are gone: at the end of every attempt, and at the start of a resumed one
(a killed run's cells could not unlink theirs). Segments of other runs' processes are never touched.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

State = Literal["running", "failed", "finished"]
PIDS = "pids.txt"
"""Under the run's log directory: one `<pid> <name>` line per child process started."""
STEPS = "steps.jsonl"
"""The core's line per completed step (applied or skipped), in the run directory."""


class RunDirError(RuntimeError):
    """The run directory cannot be used for this run (the message says why and what to do)."""


class RunBusy(RunDirError):
    """Another live `gyre run` holds the directory's lock."""


class RunFinished(RunDirError):
    """The directory holds a finished run; it is kept, not overwritten."""


class RunUnfinished(RunDirError):
    """The directory holds a run that did not finish; only `--resume` continues it."""


class NothingToResume(RunDirError):
    """`--resume` of a directory that holds no run."""


@dataclass
class RunDir:
    path: Path
    attempt: int
    """0 for a fresh run; n for the n-th resume."""
    config: dict[str, Any]
    """The configuration the run was started with (a resume uses it, not a new file)."""
    _fd: int
    restarted: dict[str, Any] | None = None
    """The state file of a run that never reached its first step, which this claim starts again with a
    new configuration (None: not such a claim)."""

    @classmethod
    def claim(cls, path: Path, config: dict[str, Any] | None, *, resume: bool) -> RunDir:
        """Lock `path` and start attempt 0 with `config`, or (resume) the next attempt of the run there."""
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / "run.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunBusy(
                f"{path} is in use by a live gyre run (its lock {path / 'run.lock'} is held)"
            ) from None
        restarted = None
        try:
            prev = read_state(path)
            if prev is None:
                if resume:
                    raise NothingToResume(f"{path} holds no run to resume (no run.json)")
                assert config is not None
                attempt, cfg = 0, config
            elif prev["state"] == "finished":
                raise RunFinished(
                    f"{path} holds a finished run (kept as it is); give the new run another out_dir (--out)"
                )
            elif resume:
                attempt, cfg = int(prev["attempt"]) + 1, prev["config"]
            elif steps_done(path) == 0:
                assert config is not None
                attempt, cfg, restarted = int(prev["attempt"]) + 1, config, prev
            else:
                raise RunUnfinished(
                    f"{path} holds a run that did not finish ({prev['state']}, attempt {prev['attempt']}); "
                    f"continue it with `gyre run --resume {path}`, or give a new run another out_dir"
                )
        except BaseException:
            os.close(fd)
            raise
        rd = cls(path, attempt, cfg, fd, restarted)
        rd.mark("running")
        return rd

    def mark(self, state: State, why: str = "") -> None:
        """Write the state file (atomically: a crash leaves the old or the new one)."""
        row = {"state": state, "attempt": self.attempt, "at": time.time(), "why": why, "config": self.config}
        tmp = self.path / "run.json.tmp"
        with open(tmp, "w") as fh:
            fh.write(json.dumps(row))
            fh.flush()
            os.fsync(fh.fileno())
        tmp.rename(self.path / "run.json")

    def next_attempt(self) -> None:
        """The run goes on in a new attempt (after a part that cannot be restarted in place failed)."""
        self.attempt += 1
        self.mark("running")

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)


def steps_done(path: Path) -> int:
    """Steps the run in `path` completed (applied or skipped): whole lines of the core's `steps.jsonl`."""
    p = path / STEPS
    if not p.is_file():
        return 0
    n = 0
    for line in p.read_text(errors="replace").splitlines():
        try:
            json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash (or a blank one)
        n += 1
    return n


def read_state(path: Path) -> dict[str, Any] | None:
    p = path / "run.json"
    if not p.exists():
        return None
    row = json.loads(p.read_text())
    if not isinstance(row, dict) or row.get("state") not in ("running", "failed", "finished"):
        raise RunDirError(f"{p} is not a gyre run state file")
    return row


def run_pids(log_dir: Path) -> set[int]:
    """Every process a run (any attempt) started, from `logs/pids.txt`."""
    p = log_dir / PIDS
    if not p.exists():
        return set()
    return {int(line.split()[0]) for line in p.read_text().splitlines() if line.strip()}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def processes_of(out: Path) -> list[int]:
    """Live processes whose command line names the run directory `out` (every child of a run does)."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if str(out).encode() in cmd:
                found.append(int(pid))
    return found


def segments_of(log_dir: Path, shm_dir: str | None = None) -> list[str]:
    """Shared-memory segments of the run's processes (any still there), by name."""
    from gyre_xfer.shm import SHM_DIR

    pids = run_pids(log_dir)
    return [
        n
        for n in os.listdir(shm_dir or SHM_DIR)
        if n.startswith("gyre-") and n.split("-")[1].isdigit() and int(n.split("-")[1]) in pids
    ]


def sweep_segments(log_dir: Path, shm_dir: str | None = None) -> list[str]:
    """Unlink the shared-memory segments (`gyre-<pid>-...`, gyre-xfer's names) made by this run's processes
    that are gone; returns the paths removed. Processes of the run still alive keep theirs."""
    from gyre_xfer.shm import SHM_DIR

    shm_dir = shm_dir or SHM_DIR
    pids = {p for p in run_pids(log_dir) if not _alive(p)}
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(shm_dir):
            parts = name.split("-")
            if len(parts) >= 3 and parts[0] == "gyre" and parts[1].isdigit() and int(parts[1]) in pids:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(shm_dir, name))
                    removed.append(os.path.join(shm_dir, name))
    return removed
