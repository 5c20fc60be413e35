"""gyre's pytest fixtures, for the workspace's tests (the root conftest.py loads this plugin):
`no_token` clears `$GYRE_TOKEN` for one test, `beyond_loopback` is an address of this machine beyond
loopback (the test is skipped, saying why, where there is none). Plain helpers are in `gyre_base.testing`."""

from __future__ import annotations

import pytest

from gyre_base.testing import non_loopback_host
from gyre_base.token import TOKEN_ENV


@pytest.fixture
def no_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """No `$GYRE_TOKEN` during the test, whatever the environment that runs the tests holds (a run
    token there would change every listener's rule). Modules that need it throughout say
    `pytestmark = pytest.mark.usefixtures("no_token")`."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)


@pytest.fixture
def beyond_loopback() -> str:
    """The first IPv4 address of this machine that is not loopback; the test is skipped without one."""
    host = non_loopback_host()
    if host is None:
        pytest.skip("this machine has no IPv4 address beyond loopback (`ip -4 addr`)")
    return host
