"""The benchmark scripts' modules (integration/bench/, a folder of scripts, not a package), for the tests."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[1] / "bench"


def bench_module(name: str) -> Any:
    """The module `name` of bench/, imported as the scripts import each other (bench/ on sys.path)."""
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))
