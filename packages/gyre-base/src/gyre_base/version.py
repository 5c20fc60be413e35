"""The version a gyre package reports: its installed metadata, or (run from a source tree without
installing) the version in its pyproject.toml. Every member's `__version__` comes from here, so the
version is declared once, in the pyproject."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

UNKNOWN = "0+unknown"
"""Reported by a module that is neither installed nor inside its source tree."""


def package_version(dist: str, init_file: str) -> str:
    """The version of distribution `dist`, whose package's `__init__.py` is `init_file` (pass
    `__file__`): installed metadata first; else `src/<module>/__init__.py`'s pyproject.toml two folders
    up (the src layout every gyre member has); else `UNKNOWN`."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        pyproject = Path(init_file).resolve().parents[2] / "pyproject.toml"
        if not pyproject.is_file():
            return UNKNOWN
        project = tomllib.loads(pyproject.read_text()).get("project", {})
        if project.get("name") != dist:
            return UNKNOWN
        return str(project["version"])
