"""pytest plugin: tests marked `mooncake` need Mooncake Transfer Engine to load in this process. Where it
cannot (no mooncake wheel, or a machine without Debian's libibverbs1) they are skipped with the reason
`gyre_xfer.mooncake.unavailable_reason` gives (what to install); with GYRE_REQUIRE_MOONCAKE=1 (CI, which
installs it) they fail with it instead. The workspace's root conftest loads it for every member's tests;
nothing is imported until a marked test runs."""

from __future__ import annotations

import os

import pytest

REQUIRE_ENV = "GYRE_REQUIRE_MOONCAKE"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("mooncake") is None:
        return
    from gyre_xfer.mooncake import unavailable_reason

    if (why := unavailable_reason()) is None:
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 and {why}", pytrace=False)
    pytest.skip(why)
