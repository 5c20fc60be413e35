"""The check every fault-free end-to-end run ends with: one attempt, nothing restarted. When it fails on a
machine nobody can look at afterwards (CI), its message is the evidence: the run's restarts and new
attempts, and the lines of its parts' logs that name an error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def what_failed(m: dict[str, Any], out: Path) -> str:
    """The run's restarts and new attempts (`metrics.json`'s `survival.events`), then the last lines of
    each part's log under `out/logs` that name an error."""
    said = [json.dumps(e) for e in m["survival"]["events"]]
    for log in sorted((out / "logs").glob("*.log")):
        lines = log.read_text(errors="replace").splitlines()
        said += [f"{log.name}: {ln}" for ln in lines if "error" in ln.lower() or "Traceback" in ln][-8:]
    return "\n".join(said) or "(no event and no log line names an error)"


def assert_no_fault(m: dict[str, Any], out: Path) -> None:
    """No fault was injected into the run in `out`: one attempt and no restart."""
    assert m["attempts"] == 1 and m["survival"]["events"] == [], what_failed(m, out)
