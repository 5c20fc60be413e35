"""gyre-xfer: bulk bytes between processes and hosts (weight snapshots, KV-cache blocks) over Mooncake
Transfer Engine or same-host shared memory."""

import importlib.metadata
import tomllib
from pathlib import Path


def _version() -> str:
    """The version in this package's metadata, as installed; run from a source tree without installing
    (its `src/` on PYTHONPATH), the one in its pyproject.toml."""
    try:
        return importlib.metadata.version("gyre-xfer")
    except importlib.metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        if not pyproject.is_file():
            return "0+unknown"
        return str(tomllib.loads(pyproject.read_text())["project"]["version"])


__version__ = _version()
