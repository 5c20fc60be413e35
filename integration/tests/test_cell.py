"""A cell whose trainer thread dies ends its process at once and says why (it used to stay up, deaf to
its steps, until the run's deadline); the core cell skips an empty step while in rollout; SIGTERM stops a
cell whose engine is still starting."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

# The core cell of a run, without an engine or a scheduler (neither is reached before the fault): its
# trainer takes an empty step, skips it, and cannot write its row because steps.jsonl is a directory.
CELL = """
import sys, time
from pathlib import Path
from gyre.cell.args import CellArgs
from gyre.cell.cell import Cell
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


def test_the_core_skips_an_empty_step_while_in_rollout(tmp_path: Path) -> None:
    # No ready group counts for a step closed with no micro-batch, so no policy moves the core cell to
    # training for it: the cell, left in rollout, must still take and skip it (every execution of the
    # run timing out before its first call used to leave the run waiting until its deadline).
    from gyre.cell.args import CellArgs
    from gyre.cell.cell import Cell
    from gyre_engine.server.model_factory import create_model
    from gyre_train.control import CoreClient

    model_dir = str(create_model(tmp_path / "model"))
    cell = Cell(CellArgs(sched="tcp://127.0.0.1:9", cell_id=0, is_core=True, capacity=1, model_dir=model_dir,
                         engine_port=9, run_dir=str(tmp_path), release_memory=False))  # fmt: skip
    cell.start_trainer()
    client = CoreClient(cell.core.address, timeout_s=30.0)
    try:
        client.open_step(0)  # streamed: opened empty, closed with nothing given
        client.submit(1, [])  # whole: submitted empty
        client.close_step(0, 0)
        deadline = time.monotonic() + 60.0
        while client.status().queue_position < 2:
            assert time.monotonic() < deadline, "the core cell in rollout never took its empty steps"
            time.sleep(0.05)
        rows = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
        taken = [(r["queue_position"], r["skipped"], r["version"]) for r in rows]
        assert taken == [(1, True, 0), (2, True, 0)]
        assert not cell.training.is_set()  # still in rollout: nothing was switched
    finally:
        client.close()
        cell.stop.set()
        cell.client.close()
        cell.core.close()


def test_the_core_cell_trains_the_model_its_directory_describes(tmp_path: Path) -> None:
    # The trainer's model is built from the directory's whole HF config (here a Llama with RoPE theta and
    # RMSNorm epsilon off their defaults), as the engine serves it: the same logits from the same weights.
    import torch
    from gyre.cell.args import CellArgs
    from gyre.cell.cell import Cell
    from gyre_engine.server.model_factory import create_model
    from gyre_train.modelconfig import ModelConfig
    from transformers import AutoModelForCausalLM

    model_dir = create_model(
        tmp_path / "model", family="llama", overrides={"rope_theta": 1e6, "rms_norm_eps": 1e-5}
    )
    cell = Cell(CellArgs(sched="tcp://127.0.0.1:9", cell_id=0, is_core=True, capacity=1, model_dir=str(model_dir),
                         engine_port=9, run_dir=str(tmp_path), release_memory=False))  # fmt: skip
    cell.start_trainer()
    try:
        assert cell.core.model_cfg == ModelConfig.from_model_dir(model_dir)
        served = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        trained = cell.core.model.eval()
        ids = torch.tensor([[5, 17, 300, 42, 7, 99]])
        with torch.no_grad():
            torch.testing.assert_close(trained(ids).logits, served(ids).logits, rtol=0, atol=1e-5)
    finally:
        cell.stop.set()
        cell.client.close()
        cell.core.close()


@pytest.mark.slow
def test_sigterm_while_the_engine_starts_stops_the_cell(tmp_path: Path) -> None:
    # A cell used to wait for its engine to come up (minutes on a loaded machine) before it looked at
    # SIGTERM, so stopping a run during start-up meant killing its cells by hand.
    import os
    import signal

    from gyre.procs.group import python_argv
    from gyre_base.ports import free_port
    from gyre_engine.server.model_factory import create_model

    model_dir = str(create_model(tmp_path / "model"))
    port = free_port()
    args = {"sched": "tcp://127.0.0.1:9", "cell_id": 0, "is_core": True, "capacity": 1, "model_dir": model_dir,
            "engine_port": port, "run_dir": str(tmp_path), "release_memory": False,
            "startup_timeout_s": 600.0}  # fmt: skip
    proc = subprocess.Popen(
        python_argv("gyre.cli", "cell", "--args", json.dumps(args)), stderr=subprocess.PIPE, text=True
    )
    try:
        # SIGTERM as soon as the engine process exists: it is importing torch, seconds from healthy
        deadline = time.monotonic() + 120
        while not _engine_started(port):
            assert proc.poll() is None and time.monotonic() < deadline, "the cell never started its engine"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=120)  # guards a hang only: the fix stops within about 0.3 s
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "stopped while its engine was starting" in err
    assert not _engine_started(port), "the cell left its engine running"


def _engine_started(port: int) -> bool:
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"gyre_engine" in argv and str(port).encode() in argv:
            return True
    return False


@pytest.mark.slow
def test_an_engine_up_when_the_start_up_time_is_spent_is_taken(tmp_path: Path) -> None:
    # The cell asks for its engine's health only after the trainer's start-up; a warm-up that took the
    # whole start-up time used to fail the cell with "not healthy" without asking once, its engine up.
    import asyncio

    from gyre.cell.args import CellArgs
    from gyre.cell.cell import Cell
    from gyre_base.ports import free_port
    from gyre_engine.client import EngineClient
    from gyre_engine.server.model_factory import create_model

    model_dir = str(create_model(tmp_path / "model"))
    cell = Cell(CellArgs(sched="tcp://127.0.0.1:9", cell_id=0, is_core=False, capacity=1, model_dir=model_dir,
                         engine_port=free_port(), run_dir=str(tmp_path), release_memory=False,
                         startup_timeout_s=0.5))  # fmt: skip

    async def healthy() -> bool:
        async with EngineClient(cell.url, timeout_s=5.0) as c:
            return bool(await c.health(timeout=2.0))

    try:
        cell.launch_engine()
        deadline = time.monotonic() + 120.0
        while True:  # the start-up time long spent (a trainer warming up) by the time the engine is up
            try:
                if asyncio.run(healthy()):
                    break
            except Exception:
                pass
            assert time.monotonic() < deadline, "the engine never came up"
            time.sleep(0.2)
        cell.wait_engine()  # asks once more, and takes it
    finally:
        cell.stop.set()
        cell.procs.close()
