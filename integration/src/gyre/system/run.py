"""`gyre run CONFIG`: the whole system, until the last step lands: as local processes on this machine, or
placed on a Ray cluster with `[run] ray_address` (`launch.py`: where each part starts and which address it
binds).

Started here, in order: gyre-sched's service (the configured policy), cell 0 (engine + trainer core),
the other cells (engine + satellite), gyre-proxy (engines come from the scheduler, records PUSHed to the
trajectory service); in this process: the trajectory service, the rollout driver and a sampler. The run
ends when the core has applied `steps` updates and every rollout engine serves the last version; then
every child is stopped and `metrics.json` plus `timeline.png` are written to the run directory. The run
has a token (`runtoken.py`): every child gets it through `$GYRE_TOKEN`, and every ZeroMQ link carries it.
A step with nothing to train is skipped by the core (its queue position taken with no update) and
reported as skipped in `steps`. The run ends at once, as an error naming the part, when a child process dies (a
cell whose trainer or serving thread dies exits loudly), the trajectory service or the rollout driver
fails, or gyre-sched marks a cell failed (a run cannot survive that yet); and when it passes its deadline.
A full disk under the run directory stops the run once, as `diskfull.DiskFull` (no new attempt).

The run directory is claimed first (`rundir.RunDir`: an exclusive lock, a finished run refused and kept,
an unfinished one continued only by `resume=True` unless it never reached its first step, nothing
deleted); `resume.prepare` lines it up with
the core's checkpoint, from whose queue position the driver and the trajectory service start. What each
step trained goes to the ledger (`ledger.py`), and `metrics.json` carries its `accounting` of the
records. The state file says `finished` or `failed` at the end; the run's shared memory is swept.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import httpx
from gyre_sched.protocol import Action, Role

from gyre.cell.cell import CellArgs
from gyre.config import runtoken
from gyre.config.runconfig import Config, config_from_dict
from gyre.measure import predict as sim
from gyre.measure.metrics import Sample, Sampler, role_accounting, write_json, write_plot
from gyre.measure.trainwatch import train_overlap
from gyre.procs.group import ProcessGroup, python_argv, tail
from gyre.rollout.driver import Driver
from gyre.rollout.evalset import Evaluator
from gyre.system import diskfull, gpus
from gyre.system.launch import LOOPBACK, Launcher, Part, launcher_for
from gyre.system.resume import CHECKPOINT, prepare
from gyre.system.rundir import NothingToResume, RunDir, read_state, sweep_segments
from gyre.system.runparts import RunContext, RunPart
from gyre.system.supervise import Event, RestartAttempt, Supervisor, kill_leftover
from gyre.trajsvc import ledger, recordlog
from gyre.trajsvc.service import TrajectoryService

log = logging.getLogger("gyre.run")


class RunError(RuntimeError):
    """The run could not complete; the message says which part failed."""


def ensure_model(cfg: Config, out: Path, procs: ProcessGroup) -> Path:
    if cfg.run.model_dir:
        p = Path(cfg.run.model_dir)
        if not (p / "config.json").exists():
            raise RunError(f"[run] model_dir {p} is not a model directory (no config.json)")
        return p
    p = out / "model"
    if not (p / "config.json").exists():
        child = procs.start(
            "create-model",
            python_argv(
                "gyre_engine",
                "create-model",
                str(p),
                "--seed",
                str(cfg.run.seed),
                "--shape",
                cfg.run.model_shape,
                "--dtype",
                cfg.run.model_dtype,
            ),
        )
        rc = child.proc.wait(300)
        procs.children.remove(child)
        if rc != 0:
            raise RunError(f"gyre-engine create-model failed; see {child.log}")
    return p


def parts_of(cfg: Config) -> list[Part]:
    """What a launcher places: the scheduler, the proxy and each cell with its GPUs."""
    gpus = 1 if cfg.cell.device == "cuda" else 0
    return [Part("sched"), Part("proxy"), *(Part(f"cell-{i}", gpus) for i in range(cfg.run.cells))]


def _wait(what: str, ok: Callable[[], bool], check: Callable[[], None], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        check()
        if time.monotonic() > deadline:
            raise RunError(f"{what} not ready within {timeout_s:.0f} s")
        time.sleep(0.2)


def proxy_up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def resume_config(out: Path) -> Config:
    """The configuration of the run in `out` (for `gyre run --resume`), its out_dir set to `out`."""
    st = read_state(out)
    if st is None:
        raise NothingToResume(f"{out} holds no run to resume (no run.json)")
    return _located(st["config"], out)


def _located(raw: dict[str, Any], out: Path) -> Config:
    """The configuration a run was started with (`run.json`), its out_dir where the run now is."""
    cfg = config_from_dict(raw)
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, out_dir=str(out)))


def run(
    cfg: Config, say: Callable[[str], None] = print, parts: Sequence[RunPart] = (), *, resume: bool = False
) -> dict[str, Any]:
    """Run the system for `cfg`; returns the metrics (also written to out_dir/metrics.json). `parts` ride
    along (`runparts.py`); with `[eval] tasks`, the held-out evaluator is one of them. `resume`: continue
    the unfinished run in out_dir (RunDirError subclasses say why a directory is refused)."""
    out = Path(cfg.run.out_dir).resolve()
    rd = RunDir.claim(out, cfg.to_dict(), resume=resume)
    if resume:  # the run goes on as it was configured
        cfg = _located(rd.config, out)
    if rd.restarted is not None:
        was = rd.restarted
        say(
            f"gyre run: {out} held a run that never reached its first step ({was['state']}"
            + (f": {was['why'].splitlines()[0]}" if was.get("why") else "")
            + f"); it starts again with this configuration, as attempt {rd.attempt}"
        )
    events: list[Event] = []
    restarted = 0
    model_dir = Path(cfg.run.model_dir) if cfg.run.model_dir else out / "model"
    try:
        while True:
            if rd.attempt:  # a resumed or new attempt on a disk still full stops before anything starts
                diskfull.check_room(out, model_dir)
            try:
                metrics = _attempt(cfg, rd, say, parts, events)
                break
            except RestartAttempt as exc:
                full = diskfull.stopped(out, exc, model_dir)
                if full is not None:  # every new attempt would meet the same disk
                    raise full from exc
                restarted += 1
                fixed = [p.name for p in parts if not getattr(p, "restartable", False)]
                fixed += ["the held-out evaluator"] if cfg.eval.tasks else []
                if fixed or restarted > cfg.survive.max_restarts:
                    why = f"{', '.join(fixed)} cannot start again" if fixed else "[survive] max_restarts"
                    raise RunError(f"{exc}; no new attempt ({why})") from exc
                events.append(Event("attempt", str(exc).splitlines()[0], time.time(), time.time()))
                say(f"gyre run: {str(exc).splitlines()[0]}; attempt {rd.attempt + 1} continues the run")
                rd.next_attempt()
    except BaseException as exc:
        full = diskfull.stopped(out, exc, model_dir) if diskfull.is_full(exc) else None
        failed = full or exc
        try:
            rd.mark("failed", f"{type(failed).__name__}: {failed}")
        except OSError as mark_exc:  # the state file stays `running`: --resume continues that too
            log.warning("the run's state file could not be written: %s", mark_exc)
        if full is not None and full is not exc:
            raise full from exc
        raise
    finally:
        sweep_segments(out / "logs")
        rd.release()
    return metrics


def _attempt(
    cfg: Config, rd: RunDir, say: Callable[[str], None], parts: Sequence[RunPart], events: list[Event]
) -> dict[str, Any]:
    if cfg.eval.tasks and not any(isinstance(p, Evaluator) for p in parts):
        parts = [Evaluator(cfg), *parts]
    out = rd.path
    at = prepare(out, rd.attempt)
    if rd.attempt:
        say(f"gyre run: attempt {rd.attempt} resumes {out} at step {at.position} (version {at.version})")
    log_path = out / "records.msgpack"
    log_start = log_path.stat().st_size if log_path.exists() else 0
    c = cfg.run
    token = runtoken.install()  # $GYRE_TOKEN: every child inherits it, every link carries it
    procs = launcher_for(c.ray_address, out / "logs", parts_of(cfg), c.startup_timeout_s)
    sv = cfg.survive
    # parts placed by Ray are not restarted in place: supervision watches this host's processes only
    group = procs if isinstance(procs, ProcessGroup) else procs.local
    sup = Supervisor(group, sv.max_restarts, sv.backoff_s, say, sv.restart and group is procs, events)
    driver: Driver | None = None
    traj: TrajectoryService | None = None
    sampler: Sampler | None = None
    t_start = t_end = 0.0
    proxy_stats: dict[str, Any] = {}
    try:
        model_dir = ensure_model(cfg, out, procs.local)
        sched = f"tcp://{procs.host('sched')}:{procs.free_port('sched')}"
        s = cfg.sched
        procs.start(
            "sched",
            python_argv(
                "gyre_sched.cli", "serve", "--bind", sched, "--policy", c.policy,
                "--async-train-cells", str(s.async_train_cells), "--ready-fraction", str(s.ready_fraction),
                "--hold-s", str(s.hold_s), "--timeout-h", str(cfg.agent.timeout_s / 3600.0),
                "--heartbeat-s", str(s.heartbeat_s), "--failure-timeout-s", str(s.failure_timeout_s),
                "--switch-timeout-s", str(s.switch_timeout_s), "--drain-timeout-s", str(s.drain_timeout_s),
            ),
        )  # fmt: skip
        ports = [procs.free_port(f"cell-{i}") for i in range(c.cells)]
        engines = {i: f"http://{procs.host(f'cell-{i}')}:{p}" for i, p in enumerate(ports)}

        def cell(i: int, core: str = "", publisher: str = "") -> None:
            a = CellArgs(
                sched=sched, cell_id=i, is_core=i == 0, capacity=cfg.cell.capacity, model_dir=str(model_dir),
                engine_port=ports[i], run_dir=str(out), core=core, publisher=publisher, lr=cfg.train.lr,
                token_budget=cfg.train.token_budget, loss=cfg.train.loss, temperature=cfg.agent.temperature,
                release_memory=cfg.cell.release_memory, startup_timeout_s=c.startup_timeout_s,
                device=cfg.cell.device, engine_argv=tuple(gpus.engine_argv(cfg)),
                host=procs.host(f"cell-{i}"), engine=cfg.cell.engine, sglang_module=cfg.cell.sglang_module,
                checkpoint=str(out / CHECKPOINT) if i == 0 else "",
            )  # fmt: skip
            env = gpus.cell_env(cfg, i)
            (out / "cells" / f"{i}.up").unlink(missing_ok=True)
            procs.start(
                f"cell-{i}", python_argv("gyre.cli", "cell", "--args", json.dumps(a.__dict__)), env=env
            )

        say(f"gyre run: policy {c.policy}, {c.cells} cells, {c.steps} steps -> {out}")
        cell(0)
        _wait("the core cell", (out / "core.json").exists, procs.check, c.startup_timeout_s)
        info = json.loads((out / "core.json").read_text())
        for i in range(1, c.cells):
            cell(i, info["core"], info["publisher"])
            sup.watch(
                f"cell-{i}",
                partial(_restart_cell, out, i, partial(cell, i, info["core"], info["publisher"])),
                partial(lambda i: _cell_back(out, i, sampler), i),
            )
        traj = TrajectoryService(
            info["core"], sched, cfg.batch.queries, streaming=cfg.streams,
            token_budget=cfg.train.token_budget, j_max=cfg.train.j_max, report_s=cfg.driver.report_s,
            first_step=at.position, on_closed=ledger.Ledger(out, rd.attempt).closed,
        )  # fmt: skip
        proxy_host = procs.host("proxy")
        proxy_url = f"http://{proxy_host}:{procs.free_port('proxy')}"
        proxy_argv = python_argv(
            "gyre_proxy.cli", "serve", "--tokenizer", str(model_dir), "--port", proxy_url.rsplit(":", 1)[1],
            "--host", proxy_host, *(["--allow-remote"] if proxy_host != LOOPBACK else []),
            "--sched", sched, "--record-log", str(log_path), "--record-push", traj.address,
            "--pick-wait", str(cfg.proxy.pick_wait_s), "--drain-grace", str(cfg.proxy.drain_grace_s),
        )  # fmt: skip
        procs.start("proxy", proxy_argv)
        sup.watch(
            "proxy",
            partial(_restart_proxy, procs, proxy_argv, log_path, log_start, traj),
            lambda: proxy_up(proxy_url),
        )
        sampler = Sampler(sched, engines, core=info["core"])
        sampler.start()

        def registered() -> bool:
            st = sampler.last_state if sampler else None
            return st is not None and len(st.cells) == c.cells

        def healthy() -> None:
            _check_health(procs, traj, driver, sampler, sup)

        _wait("the cells (engines up, registered with gyre-sched)", registered, healthy, c.startup_timeout_s)
        _wait("gyre-proxy", lambda: proxy_up(proxy_url), healthy, c.startup_timeout_s)
        say(f"gyre run: {c.cells} cells registered, proxy at {proxy_url}; rollout starts")
        traj.start()
        driver = Driver(
            cfg, proxy_url, sched, traj, sim.durations(cfg), first_step=at.position, attempt=rd.attempt
        )
        ctx = RunContext(cfg, out, proxy_url, driver, traj, sampler, info["publisher"])
        for rider in parts:
            rider.start(ctx)
        t_start = time.time()
        driver.start()
        deadline = time.monotonic() + c.deadline_s
        last_say = 0.0
        while True:
            healthy()
            for rider in parts:
                rider.tick(ctx)
            if traj.applied >= c.steps and driver.done.is_set() and all(p.done() for p in parts):
                break
            if time.monotonic() > deadline:
                raise RunError(f"the run did not finish within [run] deadline_s = {c.deadline_s:.0f} s")
            if time.monotonic() - last_say > 5.0:
                last_say = time.monotonic()
                say(_progress(t_start, driver, traj, sampler, out))
            time.sleep(0.1)
        t_end = _last_step_end(out)
        final = traj.version  # from the same core status as `applied`; below `steps` if any was skipped
        _wait(
            "the last weight version on every rollout engine",
            lambda: _engines_at(sampler, final),
            healthy,
            60.0 + (c.startup_timeout_s if sup.pending() else 0.0),
        )
        proxy_stats = _proxy_stats(proxy_url)
        say(_progress(t_start, driver, traj, sampler, out))
    finally:
        for rider in parts:
            rider.stop()
        for part in (driver, traj, sampler):
            if part is not None:
                part.stop()
        procs.close()
        token.uninstall()
    assert driver is not None and traj is not None and sampler is not None
    metrics = collect(cfg, out, t_start, t_end, driver, traj, sampler)
    metrics["moves"] = _moves(proxy_stats)
    metrics["attempt"] = rd.attempt
    metrics["attempts"] = rd.attempt + 1  # attempts of the run so far, resumes and new attempts included
    metrics["survival"] = {"events": [e.to_dict() for e in events]}
    metrics["accounting"] = ledger.account(out, traj.applied).to_dict()
    write_json(out / "metrics.json", metrics)
    with open(out / "samples.jsonl", "w") as fh:
        for smp in sampler.samples:
            fh.write(json.dumps(smp.__dict__) + "\n")
    with open(out / "train-samples.jsonl", "w") as fh:
        for ts in sampler.training().samples:
            fh.write(json.dumps(ts.__dict__) + "\n")
    plot = write_plot(metrics, sampler.samples, sampler.training(), out / "timeline.png")
    say(
        f"gyre run: done in {metrics['end_to_end_s']:.1f} s; idle rollout {metrics['roles']['idle_rollout']}, "
        f"idle training {metrics['roles']['idle_training']}, switches {metrics['switches']}; "
        f"metrics {out / 'metrics.json'}" + (f", plot {plot}" if plot else "")
    )
    rd.mark("finished")
    return metrics


def _proxy_stats(url: str) -> dict[str, Any]:
    """gyre-proxy's `/gyre/stats` at the end of the run ({} if it cannot be read: the metrics say null)."""
    try:
        r = httpx.get(f"{url}/gyre/stats", timeout=10.0)
        r.raise_for_status()
        return dict(r.json())
    except (httpx.HTTPError, ValueError) as exc:
        log.warning("gyre-proxy's stats could not be read: %s", exc)
        return {}


def _moves(stats: dict[str, Any]) -> dict[str, Any]:
    """Calls the proxy moved off a draining engine, and how many took their KV along (`kv_migrations`)."""
    keys = ("moved_calls", "prefix_moved_calls", "prefix_moved_tokens", "reprefilled_tokens", "engine_errors")
    m: dict[str, Any] = {k: stats.get(k) for k in keys}
    m["kv_migrations"] = stats.get("prefix_moved_calls")
    return m


def _check_health(
    procs: Launcher,
    traj: TrajectoryService | None,
    driver: Driver | None,
    sampler: Sampler | None,
    sup: Supervisor | None = None,
) -> None:
    """Raise (ChildDied, RunError or, when supervising, RestartAttempt; naming the part and why) if any
    part of the run has failed and cannot be restarted in place; restart those that can (`sup`)."""
    if sup is not None:
        sup.check()
    else:
        procs.check()
    fatal = RestartAttempt if sup is not None and sup.restart else RunError
    why = traj.failure() if traj is not None else None
    if traj is not None and why is not None:
        raise fatal(f"the trajectory service failed: {why}") from traj.error
    if driver is not None and driver.error is not None:
        raise fatal(f"the rollout driver failed: {driver.error}") from driver.error
    st = sampler.last_state if sampler is not None else None
    failed = [v for v in (st.cells if st is not None else ()) if v.role is Role.FAILED]
    if sup is not None and sup.restart:  # a stopped or stuck satellite is killed, then restarted
        failed = [v for v in failed if v.is_core or not _restart_failed(sup, f"cell-{v.cell_id}")]
    if failed:
        sched = next((ch.log for ch in procs.children if ch.name == "sched"), None)
        said = [ln for ln in tail(sched, 200).splitlines() if " failed (" in ln] if sched else []
        names = ", ".join(f"cell {v.cell_id}" + (" (the trainer core)" if v.is_core else "") for v in failed)
        raise fatal(
            f"gyre-sched marked {names} failed"
            + (f": {said[-1].strip()}" if said else "")
            + ("; a new attempt continues the run" if fatal is RestartAttempt else "; restarts are off")
        )


def _restart_failed(sup: Supervisor, part: str) -> bool:
    """A satellite cell gyre-sched failed is being restarted, or is killed now to be restarted."""
    return sup.restarting(part) or sup.kill(part, "was failed by gyre-sched")


def _cell_back(out: Path, i: int, sampler: Sampler | None) -> bool:
    """The restarted cell `i` was welcomed by gyre-sched (`cells/<i>.up`) and gyre-sched's state shows
    it registered again (not the failed old one); until then a failed cell `i` is not killed again."""
    st = sampler.last_state if sampler is not None else None
    me = [v for v in (st.cells if st is not None else ()) if v.cell_id == i]
    return (out / "cells" / f"{i}.up").exists() and bool(me) and me[0].role is not Role.FAILED


def _restart_cell(out: Path, i: int, start: Callable[[], None]) -> None:
    """A satellite cell again: its old engine killed if it outlived the cell (it holds the port)."""
    kill_leftover(out / "logs", f"engine-{i}")
    start()


def _restart_proxy(
    procs: Launcher, argv: list[str], log_path: Path, log_start: int, traj: TrajectoryService
) -> None:
    """The proxy again, on its port and log (a torn last frame set aside first); every record of this
    attempt in the log replayed into the trajectory service (calls already there are skipped)."""
    aside = recordlog.set_aside_torn_tail(log_path)
    if aside is not None:
        log.warning("the proxy's log had a torn last frame; moved to %s", aside)
    procs.start("proxy", argv)
    traj.replay(c for _, c in recordlog.calls(log_path, log_start))


def _progress(t0: float, driver: Driver, traj: TrajectoryService, sampler: Sampler | None, out: Path) -> str:
    with driver.lock:
        running = len(driver.state.running)
        finished = len(driver.state.outcomes)
    roles = ""
    if sampler is not None and sampler.samples:
        last = sampler.samples[-1]
        roles = " ".join(f"{cid}:{Role(r).name.lower()}" for cid, r in sorted(last.roles.items()))
    skipped = sum(bool(r.get("skipped")) for r in _steps(out))
    return (
        f"[{time.time() - t0:6.1f}s] executions running {running}, finished {finished}; records {traj.records}; "
        f"steps handed to the trainer {traj.steps_closed}, applied {traj.applied}"
        + (f" ({skipped} skipped: nothing to train)" if skipped else "")
        + f"; cells {roles}"
    )


def _last_step_end(out: Path) -> float:
    rows = _steps(out)
    if not rows:
        raise RunError("the core reported no step")
    return float(rows[-1]["t_end"])


def _steps(out: Path) -> list[dict[str, Any]]:
    p = out / "steps.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []


def _at_least(v: str | None, version: int) -> bool:
    return v is not None and v.isdigit() and int(v) >= version


def _engines_at(sampler: Sampler | None, version: int) -> bool:
    """No cell mid-switch, and every rollout cell's engine serves `version` or newer."""
    if sampler is None or not sampler.samples:
        return False
    last = sampler.samples[-1]
    if any(r not in (int(Role.ROLLOUT), int(Role.TRAINING)) for r in last.roles.values()):
        return False
    rollout = [cid for cid, r in last.roles.items() if r == int(Role.ROLLOUT)]
    return bool(rollout) and all(_at_least(last.engine_version.get(cid), version) for cid in rollout)


def _switch_times(samples: list[Sample]) -> dict[str, list[float]]:
    """Seconds from leaving a role to arriving in the other, per switch (sampling resolution)."""
    out: dict[str, list[float]] = {"to_training_s": [], "to_rollout_s": []}
    left: dict[int, tuple[float, int]] = {}
    prev: dict[int, int] = {}
    for s in samples:
        for cid, r in s.roles.items():
            p = prev.get(cid)
            if p == int(Role.ROLLOUT) and r != p:
                left[cid] = (s.t, int(Role.TRAINING))
            elif p == int(Role.TRAINING) and r != p:
                left[cid] = (s.t, int(Role.ROLLOUT))
            if cid in left and r == left[cid][1]:
                t, to = left.pop(cid)
                out["to_training_s" if to == int(Role.TRAINING) else "to_rollout_s"].append(round(s.t - t, 3))
            prev[cid] = r
    return out


def collect(
    cfg: Config,
    out: Path,
    t0: float,
    t1: float,
    driver: Driver,
    traj: TrajectoryService,
    sampler: Sampler,
) -> dict[str, Any]:
    samples = sampler.samples
    rows = _steps(out)
    closed = {int(r["step"]): r for r in ledger.read(out / ledger.LEDGER)}
    outcomes = driver.outcomes()
    track = sampler.training()
    overlap = train_overlap(samples, track, outcomes, t0, t1)
    batch_end: dict[int, float] = {}
    for o in outcomes:
        batch_end[o["step"]] = max(batch_end.get(o["step"], 0.0), o["end"])
    steps: list[dict[str, Any]] = []
    for r in rows:
        k = int(r["queue_position"]) - 1  # the run's step (a skipped one makes no update: `step` stays)
        summary = traj.steps[k].summary if k in traj.steps else closed.get(k, {})
        v = int(r["version"])
        reached = _push_reached(samples, r["t_end"], v)
        steps.append(
            {
                "step": k,
                "version": v,
                "t_start": r["t_start"],
                "t_end": r["t_end"],
                "elapsed_s": r["elapsed_s"],
                "skipped": bool(r.get("skipped", False)),
                "push_s": round(reached[0] - r["t_end"], 3) if reached else None,
                "groups": cfg.batch.queries,
                "training_cells": len(r["by_replica"]),
                "by_replica": r["by_replica"],
                "microbatches": r["microbatches"],
                "loss": r["loss"],
                "grad_norm": r["grad_norm"],
                "loss_metrics": r.get("metrics", {}),
                "staleness_mean": r["staleness"]["mean"],
                "staleness_max": r["staleness"]["max"],
                "busy_cell_s": 0.0,
                "overlap_cell_s": 0.0,
                "train_first": None,
                **overlap["per_step"].get(str(k), {}),
                "batch_end": batch_end.get(k),
                **{
                    k2: summary.get(k2)
                    for k2 in (
                        "executions",
                        "trained_executions",
                        "eval_failed",
                        "timed_out",
                        "mean_score",
                        "tokens",
                        "loss_tokens",
                        "output_tokens_recorded",
                        "leaves_by_role",
                        "jmax_dropped",
                        "first_given_at",
                        "closed_at",
                    )
                },
            }
        )
    state = sampler.last_state
    decisions = list(state.decisions) if state is not None else []
    stale = [s["staleness_mean"] for s in steps]
    return {
        "policy": cfg.run.policy,
        "config": cfg.to_dict(),
        "t0": t0,
        "end_to_end_s": round(t1 - t0, 3),
        "steps_applied": len(steps),
        "steps_skipped": sum(s["skipped"] for s in steps),
        "final_version": steps[-1]["version"] if steps else 0,
        "final_cells": {
            str(cid): {"role": Role(r).name.lower(), "engine_version": samples[-1].engine_version.get(cid)}
            for cid, r in sorted(samples[-1].roles.items())
        }
        if samples
        else {},
        "streaming": cfg.streams,
        "roles": role_accounting(samples, track, t0, t1),
        "train_overlap_share": overlap["train_overlap_share"],
        "train_overlap": overlap,
        "switches": len(decisions),
        "switches_to_training": sum(d.action is Action.TO_TRAINING for d in decisions),
        "switch_times": _switch_times(samples),
        "decisions": [
            {"at": round(d.at, 3), "cell": d.cell_id, "action": d.action.name, "rule": d.rule}
            for d in decisions
        ],
        "staleness_mean": round(sum(stale) / len(stale), 4) if stale else 0.0,
        "staleness_max": max((s["staleness_max"] for s in steps), default=0),
        "executions": len(outcomes),
        "timeouts": sum(o["timed_out"] for o in outcomes),
        "records": traj.records,
        "records_dropped": traj.dropped,
        "evals": [json.loads(x) for x in (out / "evals.jsonl").read_text().splitlines()]
        if (out / "evals.jsonl").exists()
        else [],
        "steps": steps,
        "outcomes": outcomes,
    }


def _push_reached(samples: list[Any], t_applied: float, version: int) -> list[float]:
    """Sample times from which every engine that was serving rollout when `version` was applied serves
    it (engines that were training get it as part of their switch back: `switch_times`, not `push_s`)."""
    after = [x for x in samples if x.t >= t_applied]
    if not after:
        return []
    serving = [cid for cid, ro in after[0].roles.items() if ro == int(Role.ROLLOUT)]
    if not serving:
        return []
    return [x.t for x in after if all(_at_least(x.engine_version.get(cid), version) for cid in serving)]
