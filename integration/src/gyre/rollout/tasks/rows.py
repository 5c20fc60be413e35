"""Reading the rows of a dataset file: JSON lines (`.jsonl`), Parquet (`.parquet`, with pyarrow: the
`gyre[data]` extra) or a directory HuggingFace `datasets` wrote with `save_to_disk`, read with pyarrow
too (its `state.json` names its Arrow stream files, in order; `datasets` itself is not needed).

Each row comes as a plain dict with where it was (`file line N` for JSON lines, `file row N`, counted
from 0, otherwise), so a bad row can be named. A file that cannot be read is a `DataError` naming it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DATA_EXTRA = "the `gyre[data]` extra (pip install 'gyre[data]': pyarrow)"


class DataError(ValueError):
    """A dataset that cannot be used: the message names the file, and the row and column when one is bad."""


def read_rows(path: str | Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, row) of each row of the dataset at `path`, in order."""
    p = Path(path)
    if p.is_dir():
        yield from _datasets_dir(p)
    elif not p.exists():
        raise DataError(f"{p}: no such file or directory")
    elif p.suffix == ".jsonl":
        yield from _jsonl(p)
    elif p.suffix == ".parquet":
        yield from _numbered(p, _parquet(p))
    else:
        raise DataError(f"{p}: use a .jsonl or .parquet file, or a directory saved by datasets' save_to_disk")


def _jsonl(p: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        fh = open(p, encoding="utf-8")  # noqa: SIM115 - closed by the with below
    except OSError as exc:
        raise DataError(f"{p}: cannot read it: {exc.strerror or exc}") from exc
    with fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{p} line {n}: not JSON: {exc}") from exc
            if not isinstance(row, dict):
                raise DataError(f"{p} line {n}: a row must be a JSON object, got {type(row).__name__}")
            yield f"{p} line {n}", row


def _numbered(p: Path, rows: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for i, row in enumerate(rows):
        yield f"{p} row {i}", row


def _pyarrow(p: Path) -> Any:
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError as exc:
        raise DataError(f"{p}: reading it needs {DATA_EXTRA}") from exc
    return pyarrow


def _parquet(p: Path) -> list[dict[str, Any]]:
    pa = _pyarrow(p)
    try:
        rows: list[dict[str, Any]] = pa.parquet.read_table(p).to_pylist()
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"{p}: not a readable Parquet file: {exc}") from exc
    return rows


def _datasets_dir(d: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    if (d / "dataset_dict.json").exists():
        try:
            splits = json.loads((d / "dataset_dict.json").read_text()).get("splits", [])
        except (OSError, json.JSONDecodeError, AttributeError):
            splits = []
        names = ", ".join(f"{d / s}" for s in splits) or "one of its split directories"
        raise DataError(f"{d} holds a DatasetDict (several splits): name one split's directory: {names}")
    state = d / "state.json"
    try:
        files = [f["filename"] for f in json.loads(state.read_text())["_data_files"]]
    except FileNotFoundError:
        raise DataError(
            f"{d}: a directory must be one that datasets' save_to_disk wrote (no state.json in it)"
        ) from None
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise DataError(f"{state}: not a datasets state file ({type(exc).__name__}: {exc})") from exc
    pa = _pyarrow(d)
    i = 0
    for name in files:
        f = d / name
        try:
            with pa.memory_map(str(f)) as source:
                table = pa.ipc.open_stream(source).read_all()
        except (OSError, pa.ArrowException) as exc:
            raise DataError(f"{f}: not a readable Arrow stream: {exc}") from exc
        for row in table.to_pylist():
            yield f"{d} row {i}", row
            i += 1
