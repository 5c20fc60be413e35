"""The run directory's ownership, the record log after a crash, the ledger's accounting, supervision's
restart budget, a full disk told from a crash: real files, real locks held by real processes, real child
processes."""

from __future__ import annotations

import errno
import json
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gyre.procs.group import ChildDied, ProcessGroup
from gyre.procs.nospace import EXIT_DISK_FULL, OutOfSpace
from gyre.system import diskfull
from gyre.system.diskfull import DiskFull
from gyre.system.resume import checkpoint_position, prepare
from gyre.system.rundir import NothingToResume, RunBusy, RunDir, RunFinished, RunUnfinished, sweep_segments
from gyre.system.supervise import RestartAttempt, Supervisor
from gyre.trajsvc import ledger, recordlog
from gyre_traj.io import MAGIC, Codec
from gyre_traj.records import Call, Role

CFG = {"run": {"steps": 2}}


def test_a_second_run_on_a_live_directory_is_refused(tmp_path: Path) -> None:
    rd = RunDir.claim(tmp_path, CFG, resume=False)
    with pytest.raises(RunBusy, match="in use by a live gyre run"):
        RunDir.claim(tmp_path, CFG, resume=False)
    with pytest.raises(RunBusy):
        RunDir.claim(tmp_path, CFG, resume=True)
    rd.release()


def test_a_lock_held_by_a_killed_run_is_free(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", f"from gyre.system.rundir import RunDir; import sys, time; "
         f"RunDir.claim(__import__('pathlib').Path({str(tmp_path)!r}), {CFG!r}, resume=False); "
         f"print('held', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    assert holder.stdout is not None and holder.stdout.readline().strip() == b"held"
    with pytest.raises(RunBusy):
        RunDir.claim(tmp_path, CFG, resume=True)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    holder.stdout.close()
    (tmp_path / "steps.jsonl").write_text('{"step": 1}\n')  # it had reached its first step
    # The killed run said `running`: a plain new run is refused, --resume continues it.
    with pytest.raises(RunUnfinished, match="--resume"):
        RunDir.claim(tmp_path, CFG, resume=False)
    rd = RunDir.claim(tmp_path, {"other": 1}, resume=True)
    assert rd.attempt == 1 and rd.config == CFG  # the run's own configuration, not the new one
    rd.release()


def test_a_finished_run_is_kept_and_nothing_is_deleted(tmp_path: Path) -> None:
    (tmp_path / "records.msgpack").write_bytes(b"precious")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "proxy.log").write_text("old log\n")
    rd = RunDir.claim(tmp_path, CFG, resume=False)  # a directory with files but no run.json: a fresh run
    assert (tmp_path / "records.msgpack").read_bytes() == b"precious"
    assert (tmp_path / "logs" / "proxy.log").read_text() == "old log\n"
    rd.mark("finished")
    rd.release()
    for resume in (False, True):
        with pytest.raises(RunFinished, match="kept"):
            RunDir.claim(tmp_path, CFG, resume=resume)
    assert (tmp_path / "records.msgpack").read_bytes() == b"precious"


def test_a_run_that_never_reached_its_first_step_starts_again_with_a_new_config(tmp_path: Path) -> None:
    rd = RunDir.claim(tmp_path, CFG, resume=False)
    rd.mark("failed", "RunError: [run] model_dir /nowhere is not a model directory")
    rd.release()
    (tmp_path / "steps.jsonl").write_text('{"step": 1')  # a line cut by a crash is no step
    rd = RunDir.claim(tmp_path, {"run": {"steps": 3}}, resume=False)
    assert (rd.attempt, rd.config) == (1, {"run": {"steps": 3}})  # the next attempt, the new config
    assert rd.restarted is not None and rd.restarted["why"].startswith("RunError: [run] model_dir")
    assert json.loads((tmp_path / "run.json").read_text())["config"] == {"run": {"steps": 3}}
    rd.mark("failed", "killed after its first step")
    rd.release()
    (tmp_path / "steps.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(RunUnfinished, match="--resume"):
        RunDir.claim(tmp_path, CFG, resume=False)


def test_gyre_run_that_failed_at_start_starts_again_with_a_corrected_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gyre.cli import main
    from gyre_engine.server.model_factory import create_model

    out = tmp_path / "run"
    bad, good = tmp_path / "bad.toml", tmp_path / "good.toml"
    bad.write_text(f'[run]\nmodel_dir = "{tmp_path / "nowhere"}"\nout_dir = "{out}"\n')
    assert main(["run", str(bad)]) == 1
    assert "is not a model directory" in capsys.readouterr().err
    # --resume repeats the run's own configuration: the same failure, and one line saying what to do
    assert main(["run", "--resume", str(out)]) == 1
    err = capsys.readouterr().err
    assert "is not a model directory" in err
    assert (
        f"never reached its first step, so --resume repeats its configuration: start it again with a corrected one (gyre run CONFIG --out {out})"
        in err
    )
    # A corrected config is taken (its model passes the check); a start-up timeout of 1 s ends it after
    # the scheduler and the core cell were started, which is as far as this test needs to go.
    model = create_model(tmp_path / "model")
    good.write_text(f'[run]\nmodel_dir = "{model}"\nout_dir = "{out}"\nstartup_timeout_s = 1.0\n')
    assert main(["run", str(good)]) == 1
    said = capsys.readouterr()
    assert (
        f"gyre run: {out} held a run that never reached its first step (failed: RunError: [run] model_dir "
        f"{tmp_path / 'nowhere'} is not a model directory (no config.json)); it starts again with this "
        "configuration, as attempt 2"
    ) in said.out
    assert "the core cell not ready within 1 s" in said.err
    state = json.loads((out / "run.json").read_text())
    assert state["attempt"] == 2 and state["config"]["run"]["model_dir"] == str(model)


def test_a_model_directory_gyre_train_does_not_build_is_refused_before_any_process_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gyre.cli import main
    from gyre_engine.server.model_factory import create_model

    # A real model directory the engine would serve, but whose attention gyre-train does not compute
    # (sliding windows): the trainer would train another forward than the engine samples from.
    model = create_model(tmp_path / "model")
    hf = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**hf, "use_sliding_window": True, "sliding_window": 64}))
    out = tmp_path / "run"
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[run]\nmodel_dir = "{model}"\nout_dir = "{out}"\nstartup_timeout_s = 30.0\n')
    assert main(["run", str(cfg)]) == 1
    err = capsys.readouterr().err
    assert f"[run] model_dir {model}: " in err and "use_sliding_window" in err
    assert not list((out / "logs").glob("*.log"))  # neither gyre-sched nor any cell was started
    assert json.loads((out / "run.json").read_text())["state"] == "failed"


def test_resume_needs_a_run(tmp_path: Path) -> None:
    with pytest.raises(NothingToResume):
        RunDir.claim(tmp_path, None, resume=True)


def test_segments_of_the_runs_dead_processes_are_swept_and_no_others(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    logs = tmp_path / "logs"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    other_dead = subprocess.Popen([sys.executable, "-c", "pass"])
    other_dead.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        logs.mkdir()
        (logs / "pids.txt").write_text(f"{dead.pid} cell-1\n{alive.pid} engine-1\n")
        names = [f"gyre-{dead.pid}-abcd1234-1", f"gyre-{dead.pid}-abcd1234-2", f"gyre-{alive.pid}-ef-1",
                 f"gyre-{other_dead.pid}-00-1", "not-gyre-1"]  # fmt: skip
        for n in names:
            (shm / n).write_bytes(b"x")
        removed = sweep_segments(logs, str(shm))
        assert sorted(Path(p).name for p in removed) == sorted(names[:2])
        assert sorted(p.name for p in shm.iterdir()) == sorted(names[2:])
    finally:
        alive.kill()
        alive.wait()


def _call(eid: str, k: int) -> Call:
    return Call(
        execution_id=eid,
        call_id=f"{eid}-c{k}",
        agent_id="main",
        role=Role.MAIN,
        input_ids=np.arange(4, dtype=np.int32),
        output_ids=np.arange(3, dtype=np.int32),
        output_logprobs=np.zeros(3, np.float32),
        weight_version=0,
    )


def _write_log(path: Path, calls: list[Call]) -> None:
    codec = Codec()
    with open(path, "wb") as fh:
        fh.write(MAGIC)
        for c in calls:
            p = codec.encode_msgpack(c)
            fh.write(struct.pack("<I", len(p)) + p)


def test_a_torn_tail_is_set_aside_and_every_whole_record_read(tmp_path: Path) -> None:
    log = tmp_path / "records.msgpack"
    _write_log(log, [_call("e0", 0), _call("e0", 1), _call("e1", 0)])
    whole = log.stat().st_size
    assert recordlog.set_aside_torn_tail(log) is None
    with open(log, "ab") as fh:  # a writer killed mid-frame: a header and part of a payload
        fh.write(struct.pack("<I", 500) + b"\x85partial")
    assert recordlog.scan(log).torn
    aside = recordlog.set_aside_torn_tail(log)
    assert aside is not None and aside.read_bytes() == struct.pack("<I", 500) + b"\x85partial"
    assert log.stat().st_size == whole
    got = [c.call_id for _, c in recordlog.calls(log)]
    assert got == ["e0-c0", "e0-c1", "e1-c0"]
    offsets = [off for off, _ in recordlog.calls(log)]
    assert [c.call_id for _, c in recordlog.calls(log, offsets[1])] == ["e1-c0"]


def _row(step: int, batch: list[str], trained: list[str], packed: dict[str, int], **kw: object) -> dict:
    return {
        "step": step,
        "batch_executions": batch,
        "not_trainable": kw.get("not_trainable", []),
        "trained_executions": trained,
        "calls_packed": packed,
        "calls_answered": kw.get("answered", packed),
    }


def test_accounting_finds_lost_twice_superseded_and_unanswered_records(tmp_path: Path) -> None:
    calls = [_call("a", 0), _call("a", 1), _call("b", 0), _call("c", 0), _call("c", 1), _call("d", 0),
             _call("x", 0), _call("f", 0), _call("g", 0), _call("g", 1)]  # fmt: skip
    _write_log(tmp_path / "records.msgpack", calls)
    lg = ledger.Ledger(tmp_path, 0)
    lg.closed(_row(0, ["a", "b"], ["a", "b"], {"a": 2, "b": 1}))  # all trained once
    lg.closed(_row(1, ["c", "d", "f"], ["c"], {"c": 1}, answered={"c": 2, "d": 1, "f": 1},
                   not_trainable=["f"]))  # fmt: skip
    lg.closed(_row(2, ["g"], ["g", "a"], {"g": 1, "a": 2}, answered={"g": 1, "a": 2}))
    lg.closed(_row(3, ["z"], [], {}))  # not applied: its records would be re-run
    acc = ledger.account(tmp_path, applied=3)
    # c: one of two answered calls packed (lost 1); d: scored, answered, never trained (lost 1);
    # a: trained in steps 0 and 2 (twice, 2 records); g: its second record was never answered;
    # x: of no applied batch (superseded); f: no valid score (untrainable).
    assert (acc.records_lost, acc.lost_examples) == (2, ["c", "d"])
    assert (acc.records_trained_twice, acc.twice_examples) == (2, ["a"])
    assert acc.records_unanswered == 1
    assert acc.records_superseded == 1 and acc.records_untrainable == 1
    assert acc.records == 10 and acc.applied_steps == 3


def test_prepare_lines_the_directory_up_with_the_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "checkpoint.old").mkdir()  # caught mid-replace: the old one is the checkpoint
    (tmp_path / "checkpoint.old" / "state.json").write_text(json.dumps({"queue_position": 2, "version": 2}))
    (tmp_path / "steps.jsonl").write_text(
        "".join(json.dumps({"queue_position": q}) + "\n" for q in (1, 2, 3)) + '{"queue_po'
    )
    lg = ledger.Ledger(tmp_path, 0)
    for k in range(4):
        lg.closed(_row(k, [f"e{k}"], [f"e{k}"], {f"e{k}": 1}))
    with open(tmp_path / ledger.LEDGER, "a") as fh:
        fh.write('{"step": 4, "batch')  # torn by the crash
    _write_log(tmp_path / "records.msgpack", [_call("e0", 0)])
    with open(tmp_path / "records.msgpack", "ab") as fh:
        fh.write(b"\x10\x00")
    (tmp_path / "core.json").write_text("{}")
    at = prepare(tmp_path, 1)
    assert (at.position, at.version) == (2, 2) == checkpoint_position(tmp_path)
    assert [json.loads(x)["queue_position"] for x in (tmp_path / "steps.jsonl").read_text().splitlines()] == [
        1,
        2,
    ]
    assert [r["step"] for r in ledger.read(tmp_path / ledger.LEDGER)] == [0, 1]
    assert at.torn_tail is not None and not recordlog.scan(tmp_path / "records.msgpack").torn
    assert not (tmp_path / "core.json").exists()


def _sleeper(pg: ProcessGroup, name: str) -> None:
    pg.start(name, [sys.executable, "-c", "import time; time.sleep(600)"])


def test_supervisor_restarts_with_backoff_then_gives_up(tmp_path: Path) -> None:
    pg = ProcessGroup(tmp_path / "logs")
    said: list[str] = []
    sup = Supervisor(pg, max_restarts=2, backoff_s=0.05, say=said.append)
    sup.watch("part", lambda: _sleeper(pg, "part"), lambda: True)
    try:
        _sleeper(pg, "part")
        _sleeper(pg, "unwatched")
        sup.check()
        assert sup.events == []
        for n in (1, 2):
            pg.children[[c.name for c in pg.children].index("part")].proc.kill()
            pg.children[[c.name for c in pg.children].index("part")].proc.wait()
            while sup.restarts["part"] < n or sup.pending():
                sup.check()
                time.sleep(0.01)
            ev = sup.events[-1]
            assert ev.part == "part" and "code -9" in ev.why
            assert ev.restarted_at is not None and ev.up_at is not None
        assert sum(c.name == "part" and c.proc.poll() is None for c in pg.children) == 1
        assert len((tmp_path / "logs" / "pids.txt").read_text().splitlines()) == 4
        part = next(c for c in pg.children if c.name == "part")
        part.proc.kill()
        part.proc.wait()
        with pytest.raises(ChildDied, match="after 2 restarts"):
            sup.check()
        pg.forget(part)
        assert sup.kill("part", "stuck") is False  # no live child of that name
        other = next(c for c in pg.children if c.name == "unwatched")
        os.kill(other.proc.pid, signal.SIGKILL)
        other.proc.wait()
        with pytest.raises(RestartAttempt, match="unwatched exited with code -9"):
            sup.check()
        fail_fast = Supervisor(pg, max_restarts=2, backoff_s=0.0, restart=False)
        with pytest.raises(ChildDied, match="unwatched exited"):
            fail_fast.check()
    finally:
        pg.close()


def test_gyre_run_on_a_live_directory_is_refused_before_anything_starts(tmp_path: Path) -> None:
    from gyre.config.runconfig import config_from_dict
    from gyre.system.run import run

    (tmp_path / "records.msgpack").write_bytes(b"the only copy of untrained records")
    live = RunDir.claim(tmp_path, CFG, resume=False)
    try:
        cfg = config_from_dict({"run": {"out_dir": str(tmp_path), "startup_timeout_s": 5.0}})
        with pytest.raises(RunBusy):
            run(cfg, say=lambda _: None)
    finally:
        live.release()
    assert (tmp_path / "records.msgpack").read_bytes() == b"the only copy of untrained records"
    assert not (tmp_path / "logs").exists()  # no process was started


def test_gyre_run_takes_a_config_or_resume(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gyre.cli import main

    for argv in (
        ["run"],
        ["run", "x.toml", "--resume", str(tmp_path)],
        ["run", "--resume", "d", "--out", "e"],
    ):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
    assert main(["run", "--resume", str(tmp_path)]) == 2  # nothing to resume there
    assert "holds no run to resume" in capsys.readouterr().err


@pytest.mark.parametrize("watched", [True, False])
def test_a_part_that_found_the_disk_full_is_neither_restarted_nor_given_a_new_attempt(
    tmp_path: Path, watched: bool
) -> None:
    pg = ProcessGroup(tmp_path / "logs")
    said: list[str] = []
    sup = Supervisor(pg, max_restarts=5, backoff_s=0.0, say=said.append)
    argv = [
        sys.executable,
        "-c",
        f"import sys; print('no room for the checkpoint'); sys.exit({EXIT_DISK_FULL})",
    ]

    def restart() -> None:
        pg.start("cell-1", argv)

    if watched:
        sup.watch("cell-1", restart, lambda: True)
    child = pg.start("cell-1", argv)
    child.proc.wait()
    try:
        with pytest.raises(
            OutOfSpace, match="cell-1 could not write for want of space; no room for the checkpoint"
        ):
            sup.check()
        assert sup.events == [] and said == [] and sup.restarts["cell-1"] == 0
    finally:
        pg.close()


def test_a_full_disk_is_told_from_its_errors(tmp_path: Path) -> None:
    """What says the disk is full, wherever it is in an error's chain: an OSError of ENOSPC, EDQUOT or
    EFBIG, a Rust extension's I/O error with one of those codes (safetensors writes the checkpoints), a
    child's exit status; and what does not."""
    import torch
    from safetensors.torch import save_file

    def raised(fn: Callable[[], object]) -> BaseException:
        try:
            fn()
        except BaseException as exc:
            return exc
        raise AssertionError("nothing raised")

    full = OSError(errno.ENOSPC, "No space left on device")
    try:
        raise RestartAttempt("the trajectory service failed") from full
    except RestartAttempt as exc:
        assert diskfull.is_full(exc) is full
        stopped = diskfull.stopped(tmp_path, exc)
    assert stopped is not None and str(stopped).startswith(
        f"no space left to write ([Errno 28] No space left on device): {tmp_path} has "
    )
    assert diskfull.is_full(ChildDied("cell-0 exited", EXIT_DISK_FULL)) is not None
    assert diskfull.is_full(ChildDied("cell-0 exited", 70)) is None
    assert diskfull.is_full(OSError(errno.EACCES, "Permission denied")) is None
    # safetensors' own error type, from a real write into a directory that is not there
    missing = raised(lambda: save_file({"w": torch.zeros(4)}, str(tmp_path / "nowhere" / "w.safetensors")))
    assert "(os error 2)" in str(missing) and diskfull.is_full(missing) is None
    # and from a write past a file-size limit (EFBIG), in a process of its own that has the limit
    probe = (
        "import resource, torch; from safetensors.torch import save_file; from gyre.system import diskfull\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, resource.RLIM_INFINITY))\n"
        f"try: save_file({{'w': torch.zeros(1 << 16)}}, {str(tmp_path / 'w.safetensors')!r})\n"
        "except Exception as exc: print(type(exc).__name__, diskfull.is_full(exc) is exc)\n"
    )
    said = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert said.stdout == "SafetensorError True\n", said.stderr
    (tmp_path / "w.safetensors").unlink(missing_ok=True)
    # an unrelated failure with room to spare is no disk matter; with less room than a step needs it is
    assert diskfull.stopped(tmp_path, RestartAttempt("cell-0 exited with code 70")) is None
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "model.safetensors").write_bytes(b"\0" * 4096)
    assert diskfull.needed(tmp_path) == 4096 + diskfull.MARGIN
    room = diskfull.free(tmp_path)
    os.truncate(
        (tmp_path / "checkpoint" / "model.safetensors"), room
    )  # sparse: a checkpoint as big as the room
    with pytest.raises(
        DiskFull, match=r"\(found before the attempt starts\): .* has [\d,]+ MiB free, the run needs about"
    ):
        diskfull.check_room(tmp_path)
    stopped = diskfull.stopped(tmp_path, RestartAttempt("cell-0 exited with code 70"))
    assert stopped is not None and "(a part failed: cell-0 exited with code 70)" in str(stopped)


def test_a_new_attempt_says_why_the_part_died(tmp_path: Path) -> None:
    # A part that is not restartable in place died with a traceback in its log: the run's message for the
    # new attempt carries the log's last lines (it used to print only the first line, "last lines:").
    from gyre.system.run import new_attempt_message

    pg = ProcessGroup(tmp_path / "logs")
    sup = Supervisor(pg, max_restarts=2, backoff_s=0.0)
    code = "import sys; print('working', flush=True); sys.exit('RuntimeError: out of memory in step 0')"
    pg.start("cell-0", [sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 60.0
        with pytest.raises(RestartAttempt) as info:
            while time.monotonic() < deadline:
                sup.check()
                time.sleep(0.05)
        msg = new_attempt_message(info.value, 1)
        first, *rest = msg.splitlines()
        assert first == "gyre run: cell-0 exited with code 1 (not restartable in place); last lines:; " \
            "attempt 1 continues the run"  # fmt: skip
        assert "    RuntimeError: out of memory in step 0" in rest and "    working" in rest
    finally:
        pg.close()
