"""The test helpers (`gyre_base.testing`) and the plugin's fixtures: polling fails naming what it waited
for, and stops early on a failure `check` reports; a free port can be bound; the fixtures clear the token
and find (or skip without) an address beyond loopback."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import subprocess
import sys
import time

import pytest
from gyre_base.testing import env_without_token, free_port, non_loopback_host, until, until_async
from gyre_base.token import TOKEN_ENV


def test_until_returns_once_the_condition_holds() -> None:
    t0 = time.monotonic()
    until(lambda: time.monotonic() - t0 > 0.05, "50 ms to pass", 10.0)


def test_until_fails_naming_what_it_waited_for() -> None:
    with pytest.raises(AssertionError, match=r"not within 0\.1 s: the impossible"):
        until(lambda: False, "the impossible", 0.1)


def test_until_stops_at_once_when_the_check_fails() -> None:
    def dead() -> None:
        raise RuntimeError("the peer exited")

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="the peer exited"):
        until(lambda: False, "a dead peer", 30.0, check=dead)
    assert time.monotonic() - t0 < 10.0  # not the whole timeout


def test_until_async_lets_the_loop_run() -> None:
    async def main() -> None:
        done = asyncio.Event()
        asyncio.get_running_loop().call_later(0.05, done.set)
        await until_async(done.is_set, "the timer", 10.0)
        with pytest.raises(AssertionError, match=r"not within 0\.1 s: never"):
            await until_async(lambda: False, "never", 0.1)

    asyncio.run(main())


def test_a_free_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_non_loopback_host_is_an_address_of_this_machine_or_none() -> None:
    host = non_loopback_host()
    if host is None:
        pytest.skip("this machine has no IPv4 address beyond loopback (`ip -4 addr`)")
    assert not ipaddress.ip_address(host).is_loopback
    with socket.socket() as s:
        s.bind((host, 0))  # it is this machine's


def test_the_no_token_fixture_clears_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pytest run in a child process with $GYRE_TOKEN set: the test using `no_token` sees none, one
    without it sees the token, and `beyond_loopback` is an address beyond loopback (or a skip); and
    `env_without_token` leaves the token out of a child's environment."""
    monkeypatch.setenv(TOKEN_ENV, "base-test-token-0123456789abcdef")
    assert TOKEN_ENV not in env_without_token() and TOKEN_ENV in os.environ
    here = os.path.join(os.path.dirname(__file__), "plugin_probe.py")
    out = subprocess.run(
        [sys.executable, "-m", "pytest", here, "-q", "-p", "no:cacheprovider"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert ("3 passed" if non_loopback_host() else "2 passed, 1 skipped") in out.stdout, out.stdout
