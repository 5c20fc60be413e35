"""Getting a run directory ready for the next attempt of a run (`gyre run --resume DIR`).

The core's checkpoint (`checkpoint/`, written after every applied step) is the truth of what was
trained: its queue position Q says steps 0..Q-1 were applied. `prepare` makes the rest of the directory
agree with it: a checkpoint caught mid-replace is restored from `checkpoint.old`; `steps.jsonl` keeps the
core's lines of steps below Q; the ledger keeps its lines of steps below Q (`ledger.Ledger.keep_before`);
a torn last frame of the proxy's record log is set aside (`recordlog.set_aside_torn_tail`); the previous
attempt's `core.json` (addresses of a dead core) is removed; the killed run's shared-memory segments are
unlinked (`rundir.sweep_segments`). Steps Q and later are run again from their batches (ledger.py says
why, and how their abandoned records are counted).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from gyre.system.rundir import sweep_segments
from gyre.trajsvc import recordlog
from gyre.trajsvc.ledger import Ledger

log = logging.getLogger("gyre.resume")
CHECKPOINT = "checkpoint"


@dataclass(frozen=True)
class Prepared:
    position: int
    """The checkpoint's queue position: the first step this attempt runs."""
    version: int
    torn_tail: Path | None
    segments_removed: int


def checkpoint_position(out: Path) -> tuple[int, int]:
    """(queue position, version) of the core's checkpoint in `out`; (0, 0) when there is none."""
    ckpt, old = out / CHECKPOINT, out / f"{CHECKPOINT}.old"
    if not (ckpt / "state.json").exists() and (old / "state.json").exists():
        old.rename(ckpt)  # the core died between moving the old one aside and the new one in
    p = ckpt / "state.json"
    if not p.exists():
        return 0, 0
    meta = json.loads(p.read_text())
    return int(meta["queue_position"]), int(meta["version"])


def _keep_steps(out: Path, position: int) -> None:
    p = out / "steps.jsonl"
    if not p.exists():
        return
    rows = []
    for line in p.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by the crash
        if int(row["queue_position"]) <= position:
            rows.append(line)
    tmp = p.with_suffix(".tmp")
    tmp.write_text("".join(r + "\n" for r in rows))
    tmp.rename(p)


def prepare(out: Path, attempt: int) -> Prepared:
    """Make `out` agree with its checkpoint before attempt `attempt` starts (a no-op for a fresh run)."""
    removed = sweep_segments(out / "logs")
    position, version = checkpoint_position(out)
    _keep_steps(out, position)
    Ledger(out, attempt).keep_before(position)
    torn = recordlog.set_aside_torn_tail(out / "records.msgpack")
    (out / "core.json").unlink(missing_ok=True)
    if attempt:
        log.info(
            "attempt %d resumes at step %d (version %d); torn tail %s; %d segments removed",
            attempt, position, version, torn, len(removed),
        )  # fmt: skip
    return Prepared(position, version, torn, len(removed))
