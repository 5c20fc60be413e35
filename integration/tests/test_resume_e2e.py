"""`gyre run --resume` after `kill -9` of `gyre run` itself: real processes end to end (gyre-sched, two
cells with gyre-engine servers and a gyre-train core/satellite, gyre-proxy), the built-in harness. Several
minutes on a loaded 2-core machine (most of it process start-up, twice)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gyre.cli import main
from gyre.system.rundir import processes_of, segments_of
from gyre.trajsvc import ledger


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gyre_engine.server.model_factory import create_model

    return create_model(tmp_path_factory.mktemp("model") / "tiny")


def config(tmp_path: Path, model_dir: Path, steps: int, extra: str = "") -> Path:
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        f"""
[run]
model_dir = "{model_dir}"
cells = 2
steps = {steps}
seed = 3
out_dir = "{tmp_path / "run"}"
deadline_s = 900.0
startup_timeout_s = 900.0
[batch]
queries = 2
group_size = 2
[agent]
turns = 2
max_tokens = 8
median_s = 2.0
timeout_s = 8.0
{extra}
"""
    )
    return cfg


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_resume_after_kill_9_trains_every_record_once(
    tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Each batch starts once the step before it is applied (max_ahead 0): the kill below lands after the
    # first step's checkpoint and before the next step, which waits for its batch's rollout (the core
    # writes checkpoints in the background, so with batches ready it trains on while one is written).
    cfg = config(tmp_path, model_dir, steps=3, extra="[driver]\nmax_ahead = 0")
    out = tmp_path / "run"
    with open(tmp_path / "first.log", "wb") as log:
        first = subprocess.Popen([sys.executable, "-m", "gyre.cli", "run", str(cfg)], stdout=log, stderr=log)
    try:
        while not (out / "checkpoint" / "state.json").exists():  # the first step is applied
            assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            time.sleep(0.05)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    deadline = time.monotonic() + 60.0
    while processes_of(out) and time.monotonic() < deadline:  # children end on their parent's death
        time.sleep(0.2)
    assert processes_of(out) == []
    assert json.loads((out / "run.json").read_text())["state"] == "running"

    # Another run on the killed run's directory is refused and deletes nothing.
    records = (out / "records.msgpack").read_bytes()
    assert main(["run", str(cfg)]) == 1
    assert "gyre run --resume" in capsys.readouterr().err
    assert (out / "records.msgpack").read_bytes() == records

    assert main(["run", "--resume", str(out)]) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["attempt"] == 1 and m["steps_applied"] == 3
    assert [s["step"] for s in m["steps"]] == [0, 1, 2]
    assert [s["version"] for s in m["steps"]] == [1, 2, 3]
    acc = m["accounting"]
    assert acc["applied_steps"] == 3
    assert acc["records_lost"] == 0 and acc["records_trained_twice"] == 0, acc
    assert acc["records_trained"] > 0
    rows = ledger.read(out / ledger.LEDGER)
    assert [r["step"] for r in rows] == [0, 1, 2]
    trained = [e for r in rows for e in r["trained_executions"]]
    assert len(trained) == len(set(trained))
    resumed_at = min(r["step"] for r in rows if r["attempt"] == 1)
    assert resumed_at >= 1  # the step applied before the kill was not run again
    for r in rows:  # steps run again by the second attempt have their own execution ids
        assert all(("-a1-" in e) == (r["attempt"] == 1) for e in r["batch_executions"])
    assert json.loads((out / "run.json").read_text())["state"] == "finished"
    assert processes_of(out) == [] and segments_of(out / "logs") == []
    assert main(["run", "--resume", str(out)]) == 1  # finished: kept
    assert "finished run" in capsys.readouterr().err
