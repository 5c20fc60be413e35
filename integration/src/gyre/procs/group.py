"""Child processes of a run: started with their output in a log file, watched, and always stopped.

`ProcessGroup` starts every child in its own session with the kernel told to send it SIGTERM if its
parent dies (PR_SET_PDEATHSIG), so a killed `gyre run` leaves no orphans; `close()` sends SIGTERM to each
child (last started first), waits, then SIGKILLs what is left. A child that exits while the run still
needs it is a `ChildDied` naming it and the tail of its log. Every child's pid goes into
`<log_dir>/pids.txt` (`rundir.sweep_segments` finds a killed run's shared memory by it).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

_PR_SET_PDEATHSIG = 1


class ChildDied(RuntimeError):
    """A child process exited while the run needed it (`returncode`: its exit status, when known)."""

    def __init__(self, message: str, returncode: int | None = None) -> None:
        super().__init__(message)
        self.returncode = returncode


def die_with_parent() -> None:
    """Ask the kernel to SIGTERM this process when its parent dies (a `preexec_fn`: runs in the child
    between fork and exec)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def tail(path: Path, n: int = 20) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-n:]) if lines else "(its log is empty)"


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path


class ProcessGroup:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.children: list[Child] = []

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        log = self.log_dir / f"{name}.log"
        with open(log, "ab") as fh:
            proc = subprocess.Popen(
                argv,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                start_new_session=True,
                preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
            )
        with open(self.log_dir / "pids.txt", "a") as fh:
            fh.write(f"{proc.pid} {name}\n")
        child = Child(name, proc, log)
        self.children.append(child)
        return child

    def dead(self) -> list[Child]:
        """The children that have exited."""
        return [c for c in self.children if c.proc.poll() is not None]

    def forget(self, child: Child) -> None:
        """Stop watching `child` (it exited, or is being replaced)."""
        if child in self.children:
            self.children.remove(child)

    def check(self) -> None:
        """Raise ChildDied if any child has exited."""
        for c in self.children:
            rc = c.proc.poll()
            if rc is not None:
                raise ChildDied(f"{c.name} exited with code {rc}; last lines of {c.log}:\n{tail(c.log)}", rc)

    def stop(self, child: Child, timeout_s: float = 10.0) -> int | None:
        if child.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                child.proc.send_signal(signal.SIGTERM)
            try:
                child.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    child.proc.kill()
                child.proc.wait(5.0)
        return child.proc.returncode

    def close(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every child (newest first), wait up to `timeout_s` in all, then SIGKILL the rest."""
        for c in reversed(self.children):
            if c.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for c in reversed(self.children):
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    c.proc.kill()
                c.proc.wait(5.0)
        self.children.clear()


def python_argv(module: str, *args: str) -> list[str]:
    """Run `module` with this interpreter (the same venv), so no PATH lookup is involved."""
    return [sys.executable, "-m", module, *args]
