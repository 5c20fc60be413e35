"""Threads the proxy cannot live without: if one dies, the process ends loudly instead of hanging.

The record writer (no call could complete without it) and the control link (engines would stop coming
and going) run their loops through `run_or_die`: an exception that escapes the loop is printed with its
traceback and the process exits with status `THREAD_DIED`.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable

THREAD_DIED = 70
"""Exit status of a proxy one of whose essential threads died (EX_SOFTWARE)."""


def run_or_die(loop: Callable[[], None], what: str) -> None:
    try:
        loop()
    except BaseException:
        try:
            sys.stderr.write(f"gyre-proxy: the {what} thread died; exiting ({THREAD_DIED})\n")
            traceback.print_exc(file=sys.stderr)
            sys.stderr.flush()
        finally:
            os._exit(THREAD_DIED)
