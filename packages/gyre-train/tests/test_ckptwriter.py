"""Checkpoints written in the background (`ckptwriter.py`): the training thread goes on while the copy it
took is written, what is written is the state at the moment of `submit` (the trainer updates its tensors
in place right after), writes land one at a time in order, and a failed write reaches its handler."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from gyre_train import checkpoint, ckptwriter
from gyre_train.ckptwriter import CheckpointWriter
from gyre_train.core import Core, CoreConfig
from gyre_train.data import synthetic_minibatch
from gyre_train.model import ModelConfig, build_model

MC = ModelConfig()


def _core() -> Core:
    return Core(build_model(MC), MC, CoreConfig(token_budget=512))


def test_the_written_checkpoint_is_the_state_at_submit_and_resumes(tmp_path: Path) -> None:
    core = _core()
    other = _core()
    try:
        core.train_step(synthetic_minibatch(4, seed=1))
        at_submit = {n: p.detach().clone() for n, p in core.model.named_parameters()}
        w = CheckpointWriter()
        w.submit(core.state_dict(), tmp_path / "ck")
        core.train_step(synthetic_minibatch(4, seed=2))  # in place, while the copy may still be written
        assert w.wait(60) and w.written == 1
        other.load(tmp_path / "ck")
        assert (other.step, other.version, other.queue_position) == (1, 1, 1)
        for n, p in other.model.named_parameters():
            torch.testing.assert_close(p.detach(), at_submit[n], atol=0.0, rtol=0.0, msg=n)
        # the optimizer state went with it: the resumed core's next update is the live core's second
        other.train_step(synthetic_minibatch(4, seed=2))
        for (n, p), q in zip(other.model.named_parameters(), core.model.parameters(), strict=True):
            torch.testing.assert_close(p.detach(), q.detach(), atol=0.0, rtol=0.0, msg=n)
    finally:
        core.close()
        other.close()


def test_writes_land_one_at_a_time_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second `submit` waits for the first write: checkpoints land in step order, one host copy held."""
    release = threading.Event()
    started: list[int] = []
    real = checkpoint.save

    def slow_save(state: checkpoint.TrainerState, path: Path) -> Path:
        started.append(int(state["position"]["step"]))
        if len(started) == 1:
            assert release.wait(30)
        return real(state, path)

    monkeypatch.setattr(checkpoint, "save", slow_save)
    core = _core()
    try:
        w = CheckpointWriter()
        core.train_step(synthetic_minibatch(4, seed=1))
        waited_first, copy_first = w.submit(core.state_dict(), tmp_path / "ck")
        assert waited_first < 0.5 and copy_first >= 0.0  # nothing before it to wait for
        core.train_step(synthetic_minibatch(4, seed=2))
        times: list[tuple[float, float]] = []
        state = core.state_dict()
        second = threading.Thread(target=lambda: times.append(w.submit(state, tmp_path / "ck")))
        second.start()
        second.join(0.5)
        assert second.is_alive() and started == [1]  # held behind the first write
        assert not w.wait(0.1)
        release.set()
        second.join(30)
        assert not second.is_alive() and w.wait(30)
        assert started == [1, 2] and w.written == 2
        assert times[0][0] >= 0.5  # it says how long it waited for the first write
        assert checkpoint.load(tmp_path / "ck")["position"]["step"] == 2
    finally:
        core.close()


def test_a_failed_write_reaches_its_handler_and_keeps_the_checkpoint_before(tmp_path: Path) -> None:
    core = _core()
    errors: list[BaseException] = []
    try:
        w = CheckpointWriter(on_error=errors.append)
        core.train_step(synthetic_minibatch(4, seed=1))
        w.submit(core.state_dict(), tmp_path / "ck")
        assert w.wait(60) and not errors
        core.train_step(synthetic_minibatch(4, seed=2))
        (tmp_path / "a-file").write_text("")  # the next write cannot make its directory under a file
        w.submit(core.state_dict(), tmp_path / "a-file" / "ck")
        assert w.wait(60)
        assert len(errors) == 1 and isinstance(errors[0], OSError) and w.written == 1
        assert checkpoint.load(tmp_path / "ck")["position"]["step"] == 1  # the one before stays whole
    finally:
        core.close()


def test_host_copy_copies_tensors_already_on_the_host() -> None:
    t = torch.ones(4)
    state = checkpoint.TrainerState(
        model={"w": t},
        optimizer=checkpoint.OptimizerState(state={"w": {"exp_avg": t * 2}}, param_groups=[{"lr": 1.0}]),
        position={"step": 1, "version": 1, "queue_position": 1},
        layout="x",
        model_config={},
    )
    snap = ckptwriter.host_copy(state)
    t.add_(1.0)
    assert snap["model"]["w"].tolist() == [1.0] * 4 and snap["model"]["w"].data_ptr() != t.data_ptr()
    assert snap["optimizer"]["param_groups"] == [{"lr": 1.0}]


def test_a_failed_write_without_a_handler_ends_the_process_loudly(tmp_path: Path) -> None:
    """No `on_error`: the writer's failure ends its process with `THREAD_DIED`, naming the thread."""
    import subprocess
    import sys

    from gyre_train.threads import THREAD_DIED

    (tmp_path / "a-file").write_text("")
    prog = f"""
import time, torch
from pathlib import Path
from gyre_train import checkpoint
from gyre_train.ckptwriter import CheckpointWriter
t = torch.ones(2)
state = checkpoint.TrainerState(model={{"w": t}}, optimizer={{"state": {{}}, "param_groups": []}},
    position={{"step": 1, "version": 1, "queue_position": 1}}, layout="x", model_config={{}})
CheckpointWriter().submit(state, Path({str(tmp_path / "a-file" / "ck")!r}))
time.sleep(60)
"""
    p = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=120)
    assert p.returncode == THREAD_DIED, p.stderr[-2000:]
    assert f"thread {ckptwriter.WRITER!r} died" in p.stderr
