"""Tests marked `mooncake` skip, naming what to install, where Mooncake cannot load (a machine without
Debian's libibverbs1); with GYRE_REQUIRE_MOONCAKE=1 (CI, which installs it) they fail instead."""

from __future__ import annotations

import os

import pytest
from gyre_xfer.mooncake import unavailable_reason


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("mooncake") is None or (why := unavailable_reason()) is None:
        return
    if os.environ.get("GYRE_REQUIRE_MOONCAKE") == "1":
        pytest.fail(f"GYRE_REQUIRE_MOONCAKE=1 and {why}", pytrace=False)
    pytest.skip(why)
