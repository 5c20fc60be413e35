"""What a later device call needs of a run to measure its standalone figures: the run's metrics, its
record log and its kept micro-batches, packed into a few archives that a call's results folder can
return, and unpacked again where another call trains and replays them (`h200_agentic.py --from-run`).

A call returns a handful of files of at most 16 MiB each, so `pack` writes xz-compressed tars: the first
(`run-<policy>.tar.xz`) holds `metrics.json` and `records.msgpack`, the next ones
(`run-<policy>-batches-<k>.tar.xz`) the kept steps (`batches/step-*.gtb`), as many steps per archive as
keep its uncompressed bytes within `part_bytes` (micro-batches of token ids compress to about half).
`unpack` takes every part, checks that the first part's metrics and records came and that every
member is a plain file under the names above, and returns the run directory it rebuilt.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path, PurePosixPath
from typing import Final

PART_BYTES = 24 << 20
"""Uncompressed bytes of kept steps per archive: about 12 MiB compressed, within a returned file's 16."""
PRESET: Final = 3
"""xz's compression level: near the default's ratio on token ids at a fraction of its time."""
RETURNED_FILE_BYTES = 16 << 20
"""The largest file a device call returns from its results folder."""


def pack(run_dir: Path, out: Path, policy: str, part_bytes: int = PART_BYTES) -> list[Path]:
    """Archives of `run_dir` (`metrics.json`, `records.msgpack`, `batches/`) in `out`; returns their
    paths, the metrics' first. A run stopped at its deadline has `metrics-partial.json` instead: it is
    archived as `metrics.json` (its `partial` entry says why it stopped), with the steps it applied, so
    that its calls and its training are measured as far as it went. Raises FileNotFoundError when the
    run lacks one of them."""
    metrics = run_dir / "metrics.json"
    if not metrics.is_file() and (run_dir / "metrics-partial.json").is_file():
        metrics = run_dir / "metrics-partial.json"
    need = [metrics, run_dir / "records.msgpack"]
    steps = sorted((run_dir / "batches").glob("step-*.gtb"))
    for p in need:
        if not p.is_file():
            raise FileNotFoundError(f"{p}: the run wrote no metrics or records, nothing to replay")
    if not steps:
        raise FileNotFoundError(f"{run_dir / 'batches'}: no kept steps ([train] keep_batches)")
    first = out / f"run-{policy}.tar.xz"
    with tarfile.open(first, "w:xz", preset=PRESET) as t:
        t.add(metrics, arcname="metrics.json")
        t.add(need[1], arcname=need[1].name)
    groups: list[list[Path]] = [[]]
    size = 0
    for s in steps:
        n = s.stat().st_size
        if groups[-1] and size + n > part_bytes:
            groups.append([])
            size = 0
        groups[-1].append(s)
        size += n
    paths = [first]
    for k, group in enumerate(groups):
        path = out / f"run-{policy}-batches-{k}.tar.xz"
        with tarfile.open(path, "w:xz", preset=PRESET) as t:
            for s in group:
                t.add(s, arcname=f"batches/{s.name}")
        paths.append(path)
    return paths


def too_large(paths: list[Path]) -> list[str]:
    """The archives a device call would not return (over `RETURNED_FILE_BYTES`), with their sizes."""
    return [f"{p.name} ({p.stat().st_size} bytes)" for p in paths if p.stat().st_size > RETURNED_FILE_BYTES]


def unpack(archives: list[Path], dest: Path) -> Path:
    """The run directory rebuilt in `dest` from every part `pack` wrote (any order); ValueError for a
    member that is not a plain file named as `pack` names them, or a missing metrics or record log."""
    dest.mkdir(parents=True, exist_ok=True)
    for a in archives:
        with tarfile.open(a, "r:xz") as t:
            for m in t.getmembers():
                name = PurePosixPath(m.name)
                ok = m.isfile() and (
                    str(name) in ("metrics.json", "records.msgpack")
                    or (len(name.parts) == 2 and name.parts[0] == "batches" and name.suffix == ".gtb")
                )
                if not ok:
                    raise ValueError(f"{a}: unexpected member {m.name!r} (not a run archive of this bench)")
            t.extractall(dest, filter="data")
    for need in ("metrics.json", "records.msgpack"):
        if not (dest / need).is_file():
            raise ValueError(f"{dest}: no {need} among {[str(a) for a in archives]}")
    if not any((dest / "batches").glob("step-*.gtb")):
        raise ValueError(f"{dest}: no kept steps among {[str(a) for a in archives]}")
    json.loads((dest / "metrics.json").read_text())  # a truncated file fails here, not in a phase
    return dest
