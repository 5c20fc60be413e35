"""A process that cannot write for want of space: how the error is recognised, and how such a process exits.

A write that fails with ENOSPC, EDQUOT or EFBIG (a file-size limit) is not a crash that starting again could
fix. `is_full` finds such an error anywhere in an exception's chain (an `OSError`, a Rust extension's I/O
error, an `OutOfSpace`, or a child that exited with `EXIT_DISK_FULL`); a process that meets one ends with
`exit_process`, whose status `EXIT_DISK_FULL` tells its parent why even when its log could not be written.
"""

from __future__ import annotations

import errno
import os
import re
import sys
from typing import NoReturn

from gyre.procs.group import ChildDied

FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
"""Write errors that mean the disk (or the process's share of it) is full."""
EXIT_DISK_FULL = 75
"""Exit status of a `gyre cell` that could not write for want of space (EX_TEMPFAIL: it can succeed once
there is room)."""


class OutOfSpace(RuntimeError):
    """A part of the run stopped because it could not write for want of space."""


_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")
"""How Rust's `std::io::Error` shows an OS error; extensions written in Rust raise their own exception
types with it in the text only (safetensors' `SafetensorError`, which writes gyre-train's checkpoints:
`... I/O error: No space left on device (os error 28)`)."""


def _errno(exc: BaseException) -> int | None:
    if isinstance(exc, OSError):
        return exc.errno
    found = _RUST_OS_ERROR.search(str(exc))
    return int(found.group(1)) if found else None


def is_full(exc: BaseException | None) -> BaseException | None:
    """The error in `exc`'s chain (causes and contexts) that says the disk is full, or None: an OSError
    (or a Rust extension's I/O error) with a `FULL_ERRNOS` code, an `OutOfSpace` (the run's `DiskFull` is
    one), or a child that exited with `EXIT_DISK_FULL`."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OutOfSpace):  # DiskFull too
            return exc
        if isinstance(exc, ChildDied) and exc.returncode == EXIT_DISK_FULL:
            return exc
        if _errno(exc) in FULL_ERRNOS:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def exit_process(what: str, exc: BaseException) -> NoReturn:
    """End this process with `EXIT_DISK_FULL`, saying why on stderr if it still can (its log may be on the
    full disk)."""
    try:
        sys.stderr.write(f"{what}: the disk is full: {exc}; exiting with status {EXIT_DISK_FULL}\n")
        sys.stderr.flush()
    except OSError:
        pass
    os._exit(EXIT_DISK_FULL)
