"""Repository-wide pytest setup. Hypothesis deadlines are off: CI and development machines have two
loaded cores, and speed is measured by the benchmarks, never by timed asserts in tests."""

from hypothesis import settings

settings.register_profile("gyre", deadline=None)
settings.load_profile("gyre")
