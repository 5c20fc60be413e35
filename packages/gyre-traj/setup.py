"""The build of gyre-traj's optional C extension (everything else is in pyproject.toml). Optional: where
it does not compile (no C compiler), the install goes on without it and gyre-traj runs its pure-Python
path (`gyre_traj.native`)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("gyre_traj._ingest", sources=["src/gyre_traj/_ingest.c"], optional=True),
    ]
)
