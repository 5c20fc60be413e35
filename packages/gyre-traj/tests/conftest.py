"""gyre-traj's test fixtures: `live_path` runs a test with the live ingest path's native half in use
and again with it turned off (pure Python), so that each such test checks both."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from gyre_traj import native


@pytest.fixture(params=["native", "python"])
def live_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """'native' (skipped where the extension is not built) or 'python': `Forest.ingest_frame` uses its
    native half, or does not, for the whole test."""
    if request.param == "native" and not native.BUILT:
        pytest.skip("gyre_traj._ingest is not built here")
    with native.use_native(request.param == "native"):
        yield request.param
