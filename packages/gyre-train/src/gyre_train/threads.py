"""Service threads whose death takes their process down loudly.

A thread that serves a socket or trains steps and dies from an exception would leave its process up and
deaf: a socket nobody reads, a step nobody trains, and peers that wait for their timeouts. `start_thread`
runs its target on a daemon thread; if the target raises, the traceback and the thread's name go to
stderr and the process ends at once with exit status `THREAD_DIED` (`os._exit`: no other thread, handler
or `finally` can keep it alive; a supervisor sees the death and the log says why). A target that returns
ends its thread quietly.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import NoReturn

THREAD_DIED = 70
"""Exit status of a process whose service thread died (EX_SOFTWARE)."""


def start_thread(target: Callable[[], object], name: str) -> threading.Thread:
    """Start `target` on a daemon thread named `name`; its exception ends the process (see above)."""

    def run() -> None:
        try:
            target()
        except BaseException:
            die(name)

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    return t


def die(name: str) -> NoReturn:
    """Write the exception being handled to stderr, naming thread `name`, and end the process."""
    try:
        sys.stderr.write(f"gyre-train: thread {name!r} died; the process exits ({THREAD_DIED})\n")
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        sys.stdout.flush()
    finally:
        os._exit(THREAD_DIED)
