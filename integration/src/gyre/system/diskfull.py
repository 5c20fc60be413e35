"""A full disk under the run directory: told apart from a crash, named, and never retried.

A part that cannot write because the disk is full is not a crash a new attempt could fix: every attempt
would meet the same disk. A cell process that meets one exits with `procs.nospace.EXIT_DISK_FULL` (its log
may be on the same disk and stay empty), which the supervisor reports as `OutOfSpace`; in `gyre run`'s own
process the `OSError` itself says it (`procs.nospace.is_full` recognises both). Either way, and whenever a
part fails while the run directory has less free space than a step needs (`needed`), the run stops once
with `DiskFull`, which names the directory, the space free and the space needed. `gyre run --resume DIR`
continues it once there is room (nothing is lost: the checkpoint is written beside the old one and renamed,
the record log is cut back to its whole frames), and is itself refused while there is not.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from gyre.procs.nospace import OutOfSpace, is_full
from gyre.system.resume import CHECKPOINT
from gyre.system.rundir import RunDirError

MARGIN = 64 << 20
"""Room for what grows besides the checkpoint: logs, the record log, steps, the ledger, metrics."""


class DiskFull(RunDirError, OutOfSpace):
    """The run stopped: the disk under its directory is full. The message names the directory, the
    space free and the space a step needs, and says how to go on."""

    def __init__(self, out: Path, why: str, free: int, need: int) -> None:
        super().__init__(
            f"no space left to write ({why}): {out} has {_mib(free)} free, the run needs about "
            f"{_mib(need)} there (a checkpoint written beside the last one, and logs); free space, then "
            f"`gyre run --resume {out}` continues the run"
        )
        self.out = out
        self.free = free
        self.need = need


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.0f} MiB"


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def needed(out: Path, model_dir: Path | None = None) -> int:
    """Free space a step of the run in `out` needs: one more checkpoint (the new one is written beside the
    last before it replaces it; with none yet, three times the model's weights: weights and AdamW's two
    moments) and `MARGIN`."""
    ckpt = _size(out / CHECKPOINT)
    if ckpt == 0 and model_dir is not None:
        ckpt = 3 * sum(_size(p) for p in Path(model_dir).glob("*.safetensors"))
    return ckpt + MARGIN


def free(out: Path) -> int:
    """Bytes free to this user on the file system of `out`."""
    return shutil.disk_usage(out).free


def stopped(out: Path, exc: BaseException, model_dir: Path | None = None) -> DiskFull | None:
    """The `DiskFull` to stop the run with when `exc` (a part's failure) comes from a full disk, or the
    run directory has less room than a step needs; None: not a disk matter."""
    hit = is_full(exc)
    if isinstance(hit, DiskFull):
        return hit
    room, need = free(out), needed(out, model_dir)
    if hit is None and room >= need:
        return None
    why = str(hit).splitlines()[0] if hit is not None else f"a part failed: {str(exc).splitlines()[0]}"
    return DiskFull(out, why, room, need)


def check_room(out: Path, model_dir: Path | None = None) -> None:
    """DiskFull if the run directory has less room than a step needs (before a resumed or new attempt)."""
    room, need = free(out), needed(out, model_dir)
    if room < need:
        raise DiskFull(out, "found before the attempt starts", room, need)
