"""A cell whose trainer thread dies ends its process at once and says why (it used to stay up, deaf to
its steps, until the run's deadline)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# The core cell of a run, without an engine or a scheduler (neither is reached before the fault): its
# trainer takes an empty step, skips it, and cannot write its row because steps.jsonl is a directory.
CELL = """
import sys, time
from pathlib import Path
from gyre.cell import Cell, CellArgs
from gyre_engine.server.model_factory import create_model
from gyre_train.control import CoreClient

run_dir = sys.argv[1]
model_dir = str(create_model(Path(run_dir) / "model"))
cell = Cell(CellArgs(sched="tcp://127.0.0.1:9", cell_id=0, is_core=True, capacity=1, model_dir=model_dir,
                     engine_port=9, run_dir=run_dir, release_memory=False))
cell.start_trainer()
(Path(run_dir) / "steps.jsonl").mkdir()
cell.to_training()
client = CoreClient(cell.core.address, timeout_s=30.0)
client.submit(0, [])
time.sleep(30.0)
print("the cell is still up")
"""


@pytest.mark.slow
def test_a_dying_trainer_thread_ends_the_cell(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", CELL, str(tmp_path)], capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 70, proc.stdout + proc.stderr  # gyre_train.threads.THREAD_DIED
    assert "thread 'core-train' died" in proc.stderr
    assert "IsADirectoryError" in proc.stderr
    assert "still up" not in proc.stdout
