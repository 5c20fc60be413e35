"""Repository-wide pytest setup. Hypothesis deadlines are off: CI and development machines have two
loaded cores, and speed is measured by the benchmarks, never by timed asserts in tests. gyre-base's
fixtures (`no_token`, `beyond_loopback`) are loaded here for every member's tests, rather than through a
`pytest11` entry point, which would load them into the pytest runs of everyone who installs gyre-base."""

from hypothesis import settings

pytest_plugins = ["gyre_base.pytest_plugin"]

settings.register_profile("gyre", deadline=None)
settings.load_profile("gyre")
