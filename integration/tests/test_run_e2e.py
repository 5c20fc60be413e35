"""`gyre run` end to end under each policy: real processes (gyre-sched, two cells with gyre-engine servers
and a gyre-train core/satellite, gyre-proxy), the built-in harness, two optimizer steps; streamed steps
(elastic, async) and whole ones (colocate). About 60 s per policy on 2 cores."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import resource
import signal
import threading
from pathlib import Path

import pytest
import torch
from gyre.cli import main
from gyre.config.runconfig import load_config
from gyre.system.attempt import RunError
from gyre.system.diskfull import DiskFull
from gyre.system.run import resume_config, run
from gyre_train.export import read_checkpoint
from gyre_traj.io import read_records
from gyre_traj.records import Call

from .logfiles import tb_scalars, wandb_history
from .runcheck import assert_no_fault


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            found.append(f"{pid}: {cmd}")
    return found


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded tiny model, made once for the three runs."""
    from gyre_engine.server.model_factory import create_model

    return create_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.mark.slow
# colocate switches cells as elastic does (its policy is tested against the scheduler in gyre-sched and in
# test_driver.py), and async trains on a cell of its own (gyre-sched's tests); their whole runs are in
# `-m long` to keep the default suite short
@pytest.mark.parametrize(
    "policy",
    [
        "elastic",
        pytest.param("colocate", marks=pytest.mark.long),
        pytest.param("async", marks=pytest.mark.long),
    ],
)
def test_gyre_run_tiny(
    tmp_path: Path,
    model_dir: Path,
    policy: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "run"
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(
        f"""
[run]
model_dir = "{model_dir}"
policy = "{policy}"
cells = 2
steps = 2
seed = 3
out_dir = "{out}"
deadline_s = 300.0
[batch]
queries = 2
group_size = 2
[agent]
turns = 2
scripted_fallback = true
max_tokens = 8
median_s = 2.0
timeout_s = 8.0
[train]
mismatch_warn = 1e-9
[cell]
warmup = 1  # the trainer replicas warm up as on a GPU, and the run's steps still start at position 0
[proxy]
kv_transport = "cuda_ipc"  # CPU engines offer moved calls' prefixes over shared memory instead
[log]
wandb_project = "gyre-e2e"
"""
    )
    assert main(["run", str(cfg)]) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert (out / "timeline.png").stat().st_size > 0
    # No fault was injected: one attempt, nothing restarted, nothing dropped.
    assert_no_fault(m, out)
    assert m["records_dropped"] == 0

    # Versions advanced: two updates, and the rollout engines serve the last one.
    assert m["steps_applied"] == 2 and m["final_version"] == 2
    assert [s["version"] for s in m["steps"]] == [1, 2]
    rollout = [c for c in m["final_cells"].values() if c["role"] == "rollout"]
    assert rollout and all(c["engine_version"] == "2" for c in rollout)
    # Every engine pulled the weights it started with once before registering (the pull path set up).
    per_cell = m["efficiency"]["startup"]["per_cell"]
    assert sorted(per_cell) == ["0", "1"] and all(c["first_pull_s"] > 0 for c in per_cell.values())
    # Each push's end is the serving engines' own record of taking the version, not the sampler's tick.
    took = {int(p.name.split(".")[0]) for p in (out / "cells").glob("*.versions.jsonl")}
    assert took, "no cell recorded the versions its engine took"
    for s in m["steps"]:
        if s["push_s"] is not None and s["push_pull_s"] is not None:
            assert 0 <= s["push_pull_s"] <= s["push_s"] and s["push_s"] <= s["push_sampled_s"] + 0.05, s
            # ... split into its parts: gyre-engine says its pull and apply seconds, the cell its poll.
            parts = s["push_parts"]
            assert parts["apply_s"] is not None and parts["apply_s"] >= 0, parts
            assert parts["apply_wait_s"] is not None and 0 <= parts["apply_wait_s"] <= parts["apply_s"], parts
            assert parts["status_s"] >= 0 and parts["notice_s"] > -0.5, parts

    # Every execution ran and was scored; each trained one is in exactly one step's mini-batch.
    assert m["executions"] == 8
    trained = [e for s in m["steps"] for e in s["trained_executions"]]
    assert len(trained) == len(set(trained))
    for s in m["steps"]:
        assert all(e.startswith(f"s{s['step']}-") for e in s["trained_executions"])

    # Records trained once: the loss tokens of each step are exactly the output tokens the proxy logged
    # for the executions it trained (no token twice, none left out).
    logged: dict[str, int] = {}
    versions: dict[str, list[int]] = {}
    for rec in read_records(out / "records.msgpack"):
        if isinstance(rec, Call):
            logged[rec.execution_id] = logged.get(rec.execution_id, 0) + len(rec.output_ids)
            versions.setdefault(rec.execution_id, []).append(rec.weight_version)
    assert m["records"] == sum(1 for _ in read_records(out / "records.msgpack"))
    for s in m["steps"]:
        assert (
            s["loss_tokens"] == sum(logged[e] for e in s["trained_executions"]) == s["output_tokens_recorded"]
        )
        assert s["staleness_max"] <= s["step"]
    # Batch 0 was sampled by the initial weights; nothing was sampled by a version not yet trained.
    assert all(v == 0 for e, vs in versions.items() if e.startswith("s0-") for v in vs)
    assert max(v for vs in versions.values() for v in vs) <= 2

    # Streamed steps train under their batch's tail: seed 3's sample has, in each batch, a group that
    # ends seconds before the other (tool times 0.1 s against 4.8 s in batch 0), and its micro-batches
    # are trained meanwhile. Whole steps (Colocate's) never train before their batch is complete.
    assert m["streaming"] is (policy != "colocate")
    if policy == "colocate":
        assert m["train_overlap_share"] == 0.0
        assert all(s["first_given_at"] >= s["batch_end"] for s in m["steps"])
    else:
        assert m["train_overlap_share"] > 0.0
        assert any(s["first_given_at"] < s["batch_end"] for s in m["steps"])

    # The metrics are internally consistent.
    roles = m["roles"]
    for k in ("idle_rollout", "idle_training", "switching_share", "idle_total"):
        assert roles[k] is None or 0.0 <= roles[k] <= 1.0
    assert m["end_to_end_s"] > 0
    assert m["switches"] == len(m["decisions"])
    # the cells in rollout over the run, at each change: both at times (Async: one, from before the first
    # batch), fewer while a cell trained
    counts = [n for _, n in m["rollout_cells"]]
    assert max(counts) == (1 if policy == "async" else 2) and min(counts) < 2
    assert all(a != b for a, b in itertools.pairwise(counts))
    if policy == "async":  # the core moves to training once and stays there
        assert [(d["cell"], d["action"]) for d in m["decisions"]] == [(0, "TO_TRAINING")]
        assert m["final_cells"]["0"]["role"] == "training"
    else:  # the core had to move to training and back; colocate moves the whole pool
        assert m["switches_to_training"] >= (1 if policy == "elastic" else 2)
        if m["final_cells"]["0"]["role"] != "rollout":
            # ... unless the last batch was complete while the core trained: it then stays for the last
            # step (gyre-sched's train_complete_steps), which it trains, and nothing is left to roll out
            assert m["decisions"][-1] == {**m["decisions"][-1], "cell": 0, "action": "TO_TRAINING"}
            assert "core" in m["steps"][-1]["by_replica"] and m["executions"] == len(m["outcomes"])
    assert {r for s in m["steps"] for r in s["by_replica"]} >= {"core"}

    # Train-inference mismatch of each step's on-policy tokens, in steps.jsonl and metrics.json: the
    # engine and the trainer hold the same float32 weights on the CPU, so it is float noise. Step 1 trains
    # batch 0, all sampled at version 0.
    lines = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
    assert [line["mismatch"] for line in lines] == [s["mismatch"] for s in m["steps"]]
    first = m["steps"][0]["mismatch"]
    assert first["tokens"] == m["steps"][0]["loss_tokens"]
    assert all(s["mismatch"]["abs_max"] < 1e-3 for s in m["steps"])
    assert m["mismatch_abs_mean_max"] == max(s["mismatch"]["abs_mean"] for s in m["steps"])
    # Above [train] mismatch_warn (set below the noise here): said on the run's output and in the core's log.
    assert first["abs_mean"] > 1e-9
    assert "gyre run: WARNING step 1: train-inference mismatch" in capsys.readouterr().out
    core_log = (out / "logs" / "cell-0.log").read_text()
    assert "step 1: train-inference mismatch mean |logprob diff|" in core_log
    assert "core warmed up on " in core_log  # [cell] warmup = 1

    # Every step's scalars, in TensorBoard's event files and the W&B offline run, at the step's number.
    tb = tb_scalars(out / "tb")
    for name in ("train/loss", "train/mismatch/abs_mean", "train/mismatch/k3", "rollout/mean_score",
                 "train/tokens_per_s", "train/grad_norm", "train/staleness/mean"):  # fmt: skip
        assert set(tb[name]) == {1, 2}, name
    assert tb["train/loss"][2] == pytest.approx(m["steps"][1]["loss"])
    assert tb["rollout/mean_score"][1] == pytest.approx(m["steps"][0]["mean_score"])
    (run_file,) = out.glob("wandb/offline-run-*/run-*.wandb")
    rows = wandb_history(run_file)
    assert [r["_step"] for r in rows] == [1, 2]
    assert [r["train/mismatch/abs_mean"] for r in rows] == [s["mismatch"]["abs_mean"] for s in m["steps"]]

    # The trained policy (version 2) as a model directory transformers loads, with its tokenizer.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert m["policy_dir"] == str(out / "policy")
    # the run's end, part by part, after its last step was applied
    assert list(m["end_s"]) == [
        "seen", "engines_at_last_version", "checkpoint", "stop", "figures", "export", "samples", "plot",
    ]  # fmt: skip
    assert all(v >= 0.0 for v in m["end_s"].values())
    assert json.loads((out / "policy" / "gyre_export.json").read_text())["version"] == 2
    policy_model = AutoModelForCausalLM.from_pretrained(out / "policy")
    tok = AutoTokenizer.from_pretrained(out / "policy")
    assert policy_model.config.vocab_size >= len(tok)
    ids = tok("2 + 2 =", return_tensors="pt").input_ids
    assert policy_model(ids).logits.shape[:2] == ids.shape  # it runs
    _, trained, _ = read_checkpoint(out / "checkpoint")  # the core's weights at version 2
    exported = policy_model.state_dict()
    assert all(torch.equal(exported[n], w) for n, w in trained.items())

    # No process of the run is left.
    assert _processes_mentioning(str(out)) == []


def _resume(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def _config(tmp_path: Path, model_dir: Path, extra: str, deadline_s: float = 300.0, steps: int = 2) -> Path:
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        f"""
[run]
model_dir = "{model_dir}"
cells = 2
steps = {steps}
out_dir = "{tmp_path / "run"}"
deadline_s = {deadline_s}
[batch]
queries = 2
group_size = 2
[agent]
turns = 2
max_tokens = 8
{extra}
"""
    )
    return cfg


@pytest.mark.long
@pytest.mark.slow
def test_steps_with_nothing_to_train_are_skipped(tmp_path: Path, model_dir: Path) -> None:
    # Every execution times out before its first call (the harness sleeps its tool time, about 25 s here,
    # before it): each step is an empty mini-batch. The core's train thread used to die on it and the run
    # to print progress until its deadline; later, under the elastic policy, the core cell (never moved to
    # training, as no ready group counts for an empty step) never took the steps at all.
    cfg = _config(tmp_path, model_dir, "median_s = 100.0\nsigma = 0.1\nexec_sigma = 0.1\ntimeout_s = 0.3")
    said: list[str] = []
    m = run(load_config(cfg), say=said.append)
    assert m == json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert m["records"] == 0 and m["timeouts"] == m["executions"] == 8
    assert_no_fault(m, tmp_path / "run")
    assert m["steps_applied"] == 2 and m["steps_skipped"] == 2 and m["final_version"] == 0
    for k, s in enumerate(m["steps"]):
        assert (s["step"], s["skipped"], s["version"], s["microbatches"]) == (k, True, 0, 0)
        assert s["trained_executions"] == [] and s["by_replica"] == {}
    assert any("2 skipped: nothing to train" in line for line in said)
    assert _processes_mentioning(str(tmp_path / "run")) == []


@pytest.mark.long
@pytest.mark.slow
def test_a_cell_marked_failed_ends_the_run_at_once(tmp_path: Path, model_dir: Path) -> None:
    # The core cell stops answering (SIGSTOP) once rollout has started: gyre-sched marks it failed after
    # failure_timeout_s, and with restarts off the run ends with that reason instead of printing progress
    # until its deadline.
    cfg_path = _config(
        tmp_path,
        model_dir,
        "median_s = 20.0\ntimeout_s = 30.0\n[sched]\nfailure_timeout_s = 5.0\n[survive]\nrestart = false",
        240.0,
    )
    stopped: list[int] = []

    def say(line: str) -> None:
        if "rollout starts" in line:
            pids = [int(p.split(":")[0]) for p in _processes_mentioning('"cell_id": 0')]
            pids = [p for p in pids if str(tmp_path / "run") in Path(f"/proc/{p}/cmdline").read_text()]
            assert len(pids) == 1, pids
            os.kill(pids[0], signal.SIGSTOP)
            stopped.append(pids[0])
            # Let it run again well after the scheduler's verdict, so that shutting it down is quick.
            threading.Timer(15.0, _resume, (pids[0],)).start()

    try:
        with pytest.raises(RunError, match=r"gyre-sched marked cell 0 \(the trainer core\) failed: .*silent"):
            run(load_config(cfg_path), say=say)
    finally:
        for p in stopped:
            _resume(p)
    assert stopped
    assert _processes_mentioning(str(tmp_path / "run")) == []


def _core_cell(out: Path) -> int:
    pids = [int(p.split(":")[0]) for p in _processes_mentioning('"cell_id": 0')]
    pids = [p for p in pids if str(out) in Path(f"/proc/{p}/cmdline").read_text()]
    assert len(pids) == 1, pids
    return pids[0]


@pytest.mark.long
@pytest.mark.slow
def test_a_full_disk_stops_the_run_once_and_resume_continues_it(tmp_path: Path, model_dir: Path) -> None:
    # Once rollout starts, the core cell may write no file past 1.25 MiB (RLIMIT_FSIZE on the live process:
    # every write past it fails with EFBIG, as writes to a full disk fail with ENOSPC; a small tmpfs needs
    # privileges, this does not): its weight snapshots (0.8 MB) are written, its first checkpoint's AdamW
    # state (1.6 MB) is not. The run took that for a crash: new attempts, each printing `last lines:` and
    # nothing (on a full disk the log is empty).
    out = tmp_path / "run"
    cfg_path = _config(tmp_path, model_dir, "median_s = 2.0\ntimeout_s = 8.0", steps=1)
    said: list[str] = []

    def say(line: str) -> None:
        said.append(line)
        if "rollout starts" in line:
            resource.prlimit(_core_cell(out), resource.RLIMIT_FSIZE, (1_310_720, resource.RLIM_INFINITY))

    with pytest.raises(DiskFull) as stopped:
        run(load_config(cfg_path), say=say)
    msg = str(stopped.value)
    assert msg.startswith("no space left to write (cell-0 could not write for want of space; "), msg
    assert "I/O error: File too large (os error 27)" in msg, msg  # the checkpoint's write (safetensors)
    assert re.search(
        rf"\): {re.escape(str(out))} has [\d,]+ MiB free, the run needs about \d+ MiB there", msg
    )
    assert msg.endswith(f"`gyre run --resume {out}` continues the run")
    assert not [line for line in said if "attempt" in line]  # no new attempt was started
    state = json.loads((out / "run.json").read_text())
    assert (state["state"], state["attempt"]) == ("failed", 0) and state["why"].startswith("DiskFull: ")
    assert _processes_mentioning(str(out)) == []

    # The limit went with the process, as space freed would: --resume continues the run, losing nothing.
    m = run(resume_config(out), say=said.append, resume=True)
    assert (m["attempt"], m["attempts"], m["steps_applied"]) == (1, 2, 1)
    acc = m["accounting"]
    assert acc["records_lost"] == 0 and acc["records_trained_twice"] == 0 and acc["records_trained"] > 0
    assert _processes_mentioning(str(out)) == []


@pytest.mark.long
@pytest.mark.slow
def test_a_run_past_its_deadline_leaves_what_it_did(tmp_path: Path, model_dir: Path) -> None:
    # 50 steps of executions of about 8 s cannot finish in 20 s of rollout: the run fails at its deadline
    # and leaves the figures of what it did until then beside its logs.
    cfg = _config(tmp_path, model_dir, "median_s = 8.0\ntimeout_s = 30.0", deadline_s=20.0, steps=50)
    said: list[str] = []
    with pytest.raises(RunError, match=r"did not finish within \[run\] deadline_s = 20 s"):
        run(load_config(cfg), say=said.append)
    out = tmp_path / "run"
    m = json.loads((out / "metrics-partial.json").read_text())
    assert m["partial"].startswith("the run did not finish within")
    assert m["executions"] > 0 and m["records"] > 0 and m["steps_applied"] < 50
    assert 20.0 <= m["end_to_end_s"] < 60.0
    assert m["efficiency"]["calls"] > 0  # the calls the proxy recorded, from its log
    assert (out / "timeline-partial.png").stat().st_size > 0 and (out / "samples.jsonl").stat().st_size > 0
    assert not (out / "metrics.json").exists()
    assert any("metrics-partial.json" in line for line in said)
    assert _processes_mentioning(str(out)) == []
