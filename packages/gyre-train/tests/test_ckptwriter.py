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


def _state(w: torch.Tensor, m: torch.Tensor, step: int = 1) -> checkpoint.TrainerState:
    return checkpoint.TrainerState(
        model={"w": w},
        optimizer=checkpoint.OptimizerState(
            state={"w": {"exp_avg": m, "step": torch.tensor(float(step))}}, param_groups=[{"lr": 1.0}]
        ),
        position={"step": step, "version": step, "queue_position": step},
        layout="x",
        model_config={},
    )


def test_host_buffers_copy_tensors_already_on_the_host_into_memory_kept_for_the_next_copy() -> None:
    w, m = torch.ones(4), torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    buf = ckptwriter.HostBuffers()
    snap = buf.copy(_state(w, m))
    w.add_(1.0)  # the trainer updates in place after the copy
    assert snap["model"]["w"].tolist() == [1.0] * 4 and snap["model"]["w"].data_ptr() != w.data_ptr()
    assert snap["optimizer"]["state"]["w"]["exp_avg"].dtype == torch.bfloat16
    assert torch.equal(
        snap["optimizer"]["state"]["w"]["exp_avg"], torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    )
    assert (
        snap["optimizer"]["state"]["w"]["step"].shape == ()
        and float(snap["optimizer"]["state"]["w"]["step"]) == 1.0
    )
    assert snap["optimizer"]["param_groups"] == [{"lr": 1.0}] and snap["position"]["step"] == 1
    assert not buf.pinned  # host tensors: nothing to page-lock for
    where = snap["model"]["w"].data_ptr()

    again = buf.copy(_state(w, m * 2, step=2))  # same names, shapes, dtypes: the same memory
    assert buf.layouts == 1 and again["model"]["w"].data_ptr() == where
    assert (
        again["model"]["w"].tolist() == [2.0] * 4 and float(again["optimizer"]["state"]["w"]["step"]) == 2.0
    )
    assert torch.equal(again["optimizer"]["state"]["w"]["exp_avg"], m * 2)

    grown = buf.copy(_state(torch.zeros(5), m))  # another shape: laid out again
    assert buf.layouts == 2 and grown["model"]["w"].tolist() == [0.0] * 5
    buf.close()


def test_a_checkpoint_written_from_the_kept_buffer_loads_back_exactly(tmp_path: Path) -> None:
    """The views of one flat buffer are written as separate tensors (safetensors accepts them: they do
    not overlap), and a second checkpoint through the same buffer holds the second state."""
    core = _core()
    try:
        w = CheckpointWriter()
        for seed in (1, 2):
            core.train_step(synthetic_minibatch(4, seed=seed))
            w.submit(core.state_dict(), tmp_path / "ck")
            assert w.wait(60)
        assert w.buffers.layouts == 1 and w.written == 2
        back = checkpoint.load(tmp_path / "ck")
        assert back["position"]["step"] == 2
        live = core.state_dict()
        for n, t in live["model"].items():
            torch.testing.assert_close(back["model"][n], t, atol=0.0, rtol=0.0, msg=n)
        for n, st in live["optimizer"]["state"].items():
            for k, v in st.items():
                torch.testing.assert_close(
                    back["optimizer"]["state"][n][k], torch.as_tensor(v), atol=0.0, rtol=0.0
                )
        assert w.buffers.nbytes > 0 and w.close(30) and w.buffers.nbytes == 0
    finally:
        core.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_host_buffers_of_a_gpu_state_are_page_locked_and_exact() -> None:
    w = torch.randn(1000, 33, device="cuda")
    m = torch.randn(7, device="cuda", dtype=torch.bfloat16)
    buf = ckptwriter.HostBuffers()
    try:
        before = w.clone()
        snap = buf.copy(_state(w, m))
        assert buf.pinned and snap["model"]["w"].is_pinned()
        w.add_(1.0)  # queued after the copy; the copy's bytes are those before
        torch.testing.assert_close(snap["model"]["w"], before.cpu(), atol=0.0, rtol=0.0)
        torch.testing.assert_close(snap["optimizer"]["state"]["w"]["exp_avg"], m.cpu(), atol=0.0, rtol=0.0)
    finally:
        buf.close()
    assert not buf.pinned


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
