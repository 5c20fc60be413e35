"""The build of gyre-traj's optional C extensions (everything else is in pyproject.toml). Optional: where
one does not compile (no C compiler), the install goes on without it and gyre-traj runs its pure-Python
path (`gyre_traj.native`). `_arena` is POSIX only (it reserves address space with mmap)."""

import os

from setuptools import Extension, setup

extensions = [Extension("gyre_traj._ingest", sources=["src/gyre_traj/_ingest.c"], optional=True)]
if os.name == "posix":
    extensions.append(Extension("gyre_traj._arena", sources=["src/gyre_traj/_arena.c"], optional=True))

setup(ext_modules=extensions)
