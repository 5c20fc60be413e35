"""What a run trained, written as it goes, and the check that every recorded call was trained once.

The trajectory service appends one JSON line per step it hands to the core whole (`Ledger.closed`,
fsynced): the step, the attempt, the executions of its batch, those trained (`trained_executions`), those
that could not be trained (no valid score), the calls of each trained execution it packed and the
calls of each execution the harness completed (`calls_answered`). A step
is *trained* when the core has applied it: its queue position is below the core's (the checkpoint's,
after a crash). The rule for a crash (`gyre run --resume`): steps at or past the checkpoint's position
were not applied; their ledger lines are dropped (`keep_before`) and their batches are run again, by the
next attempt, under new execution ids (`s<k>-q<q>-a<attempt>-e<j>`). The records of those abandoned
executions stay in the log and are counted as `records_superseded`, never trained.

`account` reads the proxy's log (whole frames) against the ledger, over the applied steps:

- `records_trained`: records of trained executions that the trajectory service packed;
- `records_lost`: answered records (calls whose response the harness got: `calls_answered`) of executions
  of an applied step's batch with a valid score, that were not packed for training;
- `records_trained_twice`: records packed more often than the log holds them, and every record of an
  execution trained in two steps;
- `records_unanswered`: records beyond the calls the harness completed and beyond what was packed (a
  call whose client gave up or saw an error, e.g. its proxy was killed after the fsync: never an answer
  the policy acted on, so nothing depends on it being trained);
- `records_superseded`: records of executions of no applied step's batch (the rule above);
- `records_untrainable`: records of executions without a valid score (eval failed), by design untrained.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gyre.trajsvc import recordlog

LEDGER = "ledger.jsonl"


class Ledger:
    def __init__(self, out: Path, attempt: int) -> None:
        self.path = out / LEDGER
        self.attempt = attempt

    def closed(self, row: dict[str, Any]) -> None:
        line = json.dumps({**row, "attempt": self.attempt}) + "\n"
        with open(self.path, "a") as fh:
            fh.write(line)
            fh.flush()
            os.fsync(fh.fileno())

    def keep_before(self, position: int) -> None:
        """Drop the lines of steps at or past `position` (not applied), and a torn last line."""
        rows = [r for r in read(self.path) if int(r["step"]) < position]
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)
            fh.flush()
            os.fsync(fh.fileno())
        tmp.rename(self.path)


def read(path: Path) -> list[dict[str, Any]]:
    """The ledger's whole lines (a line cut by a crash is left out), the last one of each step kept."""
    if not path.exists():
        return []
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # torn by a crash mid-write: the step was not applied (it is re-run)
        by_step[int(row["step"])] = row
    return [by_step[k] for k in sorted(by_step)]


@dataclass
class Accounting:
    applied_steps: int
    records: int
    records_trained: int
    records_lost: int
    records_trained_twice: int
    records_superseded: int
    records_unanswered: int
    records_untrainable: int
    lost_examples: list[str]
    twice_examples: list[str]
    lost: dict[str, int]
    """Execution id -> its records lost."""
    twice: dict[str, int]
    """Execution id -> its records trained twice."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def account(out: Path, applied: int, log_name: str = "records.msgpack") -> Accounting:
    """Check the log against the ledger's applied steps (`applied`: the core's queue position)."""
    in_log: Counter[str] = Counter(rec.execution_id for _, rec in recordlog.calls(out / log_name))
    rows = [r for r in read(out / LEDGER) if int(r["step"]) < applied]
    batch: set[str] = set()
    untrainable: set[str] = set()
    packed: Counter[str] = Counter()
    trained_in: Counter[str] = Counter()
    for r in rows:
        batch |= set(r["batch_executions"])
        untrainable |= set(r["not_trainable"])
        for e in r["trained_executions"]:
            trained_in[e] += 1
        for e, n in r["calls_packed"].items():
            packed[e] += int(n)
    answered: dict[str, int] = {}
    for r in rows:
        answered.update({e: int(n) for e, n in r["calls_answered"].items()})
    lost: dict[str, int] = {}
    twice: dict[str, int] = {}
    unanswered = 0
    for e, n in in_log.items():
        if e not in batch or e in untrainable:
            continue
        a, p = answered.get(e, 0), packed[e] if trained_in[e] == 1 else 0
        if trained_in[e] > 1:
            twice[e] = n
            continue
        if min(n, a) > p:
            lost[e] = min(n, a) - p
        if p > n:
            twice[e] = p - n
        unanswered += max(0, n - max(p, a))
    return Accounting(
        applied_steps=len(rows),
        records=sum(in_log.values()),
        records_trained=sum(min(packed[e], n) for e, n in in_log.items() if trained_in[e] == 1),
        records_lost=sum(lost.values()),
        records_trained_twice=sum(twice.values()),
        records_superseded=sum(n for e, n in in_log.items() if e not in batch),
        records_unanswered=unanswered,
        records_untrainable=sum(n for e, n in in_log.items() if e in batch and e in untrainable),
        lost_examples=sorted(lost)[:5],
        twice_examples=sorted(twice)[:5],
        lost=lost,
        twice=twice,
    )
