"""Helpers for gyre's tests, importable without pytest: poll until a condition holds (or fail naming it
after a deadline), a free loopback port, an address of this machine beyond loopback, an environment
without the run token, an ASGI app served on loopback from a thread, and the hypothesis settings of a
fuzz test (uvicorn and hypothesis are imported only where used). The fixtures built on them are in
`gyre_base.pytest_plugin`."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from gyre_base.ports import free_port  # tests import it from here too
from gyre_base.token import TOKEN_ENV

if TYPE_CHECKING:
    from hypothesis import settings

POLL_S = 0.02
"""How often `until` and `until_async` look again."""


def until(
    cond: Callable[[], object],
    what: str,
    timeout_s: float = 30.0,
    *,
    check: Callable[[], object] | None = None,
    poll_s: float = POLL_S,
) -> None:
    """Return once `cond()` is true; after `timeout_s` fail with AssertionError naming `what` (a dead
    peer fails here, never hangs the test). `check`, called before each look, raises for a failure that
    makes waiting pointless (a process that exited, a service that reported a failure)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if check is not None:
            check()
        if cond():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(poll_s)


async def until_async(
    cond: Callable[[], object], what: str, timeout_s: float = 30.0, *, poll_s: float = POLL_S
) -> None:
    """`until` for a coroutine: sleeps with `asyncio.sleep`, so the event loop runs meanwhile."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        await asyncio.sleep(poll_s)


def non_loopback_host() -> str | None:
    """The first IPv4 address of this machine that is not loopback (from `ip -4 addr`), or None: where
    tests bind the listeners that must need the run token."""
    ip = shutil.which("ip")
    if ip is None:
        return None
    out = subprocess.run([ip, "-4", "-o", "addr", "show"], capture_output=True, text=True, check=False).stdout
    for line in out.splitlines():
        parts = line.split()
        if "inet" in parts:
            addr = parts[parts.index("inet") + 1].split("/")[0]
            if not ipaddress.ip_address(addr).is_loopback:
                return addr
    return None


def env_without_token() -> dict[str, str]:
    """This process's environment without `$GYRE_TOKEN`, for child processes that must have no token."""
    return {k: v for k, v in os.environ.items() if k != TOKEN_ENV}


class AppThread:
    """Serves an ASGI app over real HTTP on 127.0.0.1 with uvicorn, on a thread of this process (needs
    uvicorn); the constructor returns once the server listens, or raises RuntimeError after `timeout_s`
    or if the thread died. `stop()` shuts it down."""

    def __init__(
        self,
        app: Any,
        port: int | None = None,
        lifespan: Literal["auto", "on", "off"] = "auto",
        timeout_s: float = 30.0,
    ) -> None:
        import uvicorn

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan=lifespan)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, name="gyre-test-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the test server on {self.url} did not start")
            time.sleep(POLL_S)

    def stop(self, timeout_s: float = 15.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)


def fuzz_settings(cases: int) -> settings:
    """Hypothesis settings for a fuzz test over real sockets: `cases` generated cases, no deadline (the
    machine is shared), no example database (each run draws afresh) and no replay of stored examples,
    shrinking kept; the health checks for slow data generation off, since each case does real IO."""
    from hypothesis import HealthCheck, Phase
    from hypothesis import settings as hypothesis_settings

    return hypothesis_settings(
        max_examples=cases,
        deadline=None,
        database=None,
        phases=[Phase.generate, Phase.shrink],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
