"""Repository-wide pytest setup. Hypothesis deadlines are off: CI and development machines have two
loaded cores, and speed is measured by the benchmarks, never by timed asserts in tests. gyre-base's
fixtures (`no_token`, `beyond_loopback`) and gyre-xfer's gate on tests marked `mooncake` (skipped naming
what to install where Mooncake cannot load; failed instead under GYRE_REQUIRE_MOONCAKE=1) are loaded here
for every member's tests, rather than through `pytest11` entry points, which would load them into the
pytest runs of everyone who installs those packages."""

from hypothesis import settings

pytest_plugins = ["gyre_base.pytest_plugin", "gyre_xfer.pytest_gate"]

settings.register_profile("gyre", deadline=None)
settings.load_profile("gyre")
