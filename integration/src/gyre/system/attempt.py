"""One attempt of a `gyre run`, in four steps: build, start, watch, collect.

- **build**: the run directory lined up with the core's checkpoint (`resume.prepare`: the queue position
  the driver and the trajectory service start from), the run token installed in `$GYRE_TOKEN` (every
  child inherits it, every ZeroMQ link carries it), the launcher (`launch.py`: this machine or a Ray
  placement group) and the supervisor of what may be restarted in place (`supervise.py`).
- **start**: the model directory (made, or checked: `ensure_model`), then gyre-sched's service (the
  configured policy), cell 0 (engine + trainer core), the other cells (engine + satellite), and in this
  process the trajectory service, then gyre-proxy (engines come from the scheduler, records PUSHed to the
  trajectory service) and the sampler; it returns once every cell is registered and the proxy answers.
- **watch**: the parts that ride along start (`runparts.py`), the rollout driver starts the first batch,
  and every 0.1 s the health of every part is checked (a dead satellite cell or proxy is restarted by the
  supervisor; anything else fails the attempt, naming it: `RestartAttempt` when a new attempt may go on,
  `RunError` or `ChildDied` when not) and the parts are ticked. On Ray a satellite cell that is lost
  (its process, its actor or its node gone: `launch.PartLost`) is let go and the run goes on without
  it: the core re-queues the micro-batches it had claimed, gyre-sched fails it and the proxy routes
  calls to the cells left; each loss is noted in the metrics (`survival.lost`, a `Lost` each, with
  `recovery_s`: from its actor's last answer to the next step applied). A lost core, scheduler or proxy
  ends the attempt (`RestartAttempt`: the next one places every part again and continues from the
  core's checkpoint); it is noted too (the run's `losses` outlive the attempt), its `seen_to_step_s`
  from the loss seen to the next attempt's first step, which `gyre run` says. The watch goes on until the core has applied `steps` updates,
  the driver and every part are done, and every rollout engine serves the last version; or the deadline.
- **collect**, after every part and child process is stopped: the trained policy exported from the
  core's checkpoint of the last version as a Hugging Face model directory, `policy/` (`policy.py`),
  `metrics.json` (`measure.runmetrics`, with the ledger's `accounting` of the records, the proxy's moved
  calls and the attempt's survival events), the samples, `timeline.png`; the run directory's state says
  `finished`. Every step's scalars went to TensorBoard (and W&B) as it was applied (`runlog.py`). An
  attempt stopped at its deadline writes what it did until then instead: `metrics-partial.json` (the
  same figures, `partial` saying why), the samples and `timeline-partial.png`; the run stays failed.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
from gyre_sched.protocol import Role
from gyre_train.modelconfig import ModelConfig, ModelConfigError

from gyre.cell.args import CellArgs
from gyre.config import runtoken
from gyre.config.runconfig import Config, part_names
from gyre.measure import efficiency, runmetrics
from gyre.measure import predict as sim
from gyre.measure.metrics import Sampler, write_json, write_plot
from gyre.measure.runmetrics import read_steps
from gyre.measure.samples import engines_serve
from gyre.procs import hostmem
from gyre.procs.group import ProcessGroup, python_argv, tail
from gyre.rollout.driver import Driver
from gyre.system import gpus, policy
from gyre.system.evaluator import Evaluator
from gyre.system.launch import LOOPBACK, Launcher, Part, PartLost, RayLauncher, launcher_for
from gyre.system.nodeagent import NodeLauncher
from gyre.system.resume import CHECKPOINT, prepare
from gyre.system.rundir import PIDS, RunDir
from gyre.system.runlog import RunLog
from gyre.system.runparts import RunContext, RunPart
from gyre.system.supervise import Event, RestartAttempt, Supervisor, kill_leftover
from gyre.trajsvc import ledger, recordlog
from gyre.trajsvc.service import TrajectoryService

log = logging.getLogger("gyre.run")


class RunError(RuntimeError):
    """The run could not complete; the message says which part failed."""


@dataclass(frozen=True)
class Lost:
    """A part lost on Ray: a satellite cell the run went on without, or a part whose loss ended the
    attempt (the core, gyre-sched, the proxy) and the next attempt placed again."""

    part: str
    node_id: str
    why: str
    alive_at: float
    """When its actor last said its process lives (wall clock)."""
    seen_at: float
    """When the run saw the loss."""
    detect_s: float
    applied_at_loss: int
    """Steps the core had applied when the loss was seen."""
    attempt: int = 0
    """The attempt it was lost in (the next one continued the run if the part was not a satellite)."""


def ensure_model(cfg: Config, out: Path, procs: ProcessGroup) -> Path:
    """The run's model directory: `[run] model_dir`, refused unless gyre-train builds it exactly (its
    `ModelConfig`, read as the core cell will read it); else a new random-init model of `model_shape`
    under `out` (made once, by `gyre-engine create-model`)."""
    if cfg.run.model_dir:
        p = Path(cfg.run.model_dir)
        if not (p / "config.json").exists():
            raise RunError(f"[run] model_dir {p} is not a model directory (no config.json)")
        try:
            ModelConfig.from_model_dir(p)
        except ModelConfigError as exc:
            raise RunError(f"[run] model_dir {p}: {exc}") from exc
        return p
    p = out / "model"
    if not (p / "config.json").exists():
        child = procs.start(
            "create-model",
            python_argv(
                "gyre_engine", "create-model", str(p), "--seed", str(cfg.run.seed),
                "--shape", cfg.run.model_shape, "--dtype", cfg.run.model_dtype,
            ),
        )  # fmt: skip
        rc = child.proc.wait(300)
        procs.children.remove(child)
        if rc != 0:
            raise RunError(f"gyre-engine create-model failed; see {child.log}")
    return p


def parts_of(cfg: Config) -> list[Part]:
    """What a launcher places: the scheduler, the proxy and each cell with its GPUs, each with the custom
    resources `[run] ray_resources` gives it."""
    gpus = 1 if cfg.cell.device == "cuda" else 0
    res = cfg.run.ray_resources
    return [
        Part(n, gpus if n.startswith("cell-") else 0, {k: float(v) for k, v in res.get(n, {}).items()})
        for n in part_names(cfg.run.cells)
    ]


def proxy_up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def attempt(
    cfg: Config,
    rd: RunDir,
    say: Callable[[str], None],
    parts: Sequence[RunPart],
    events: list[Event],
    losses: list[Lost] | None = None,
) -> dict[str, Any]:
    """One attempt of the run in `rd`; returns its metrics (module docstring). `events` and `losses`
    are the run's: every attempt adds to them, the last one's metrics carry them all."""
    a = Attempt.build(cfg, rd, say, parts, events, [] if losses is None else losses)
    late = ""
    try:
        a.start()
        a.watch()
    except DeadlinePassed as exc:
        late = str(exc)
        raise
    finally:
        a.stop()
        if late:
            a.collect_partial(late)
    return a.collect()


class DeadlinePassed(RunError):
    """The run did not finish within `[run] deadline_s` (what it did is in `metrics-partial.json`)."""


class Attempt:
    """The parts of one attempt while it runs (`attempt` drives it through its steps)."""

    def __init__(
        self,
        cfg: Config,
        rd: RunDir,
        say: Callable[[str], None],
        parts: Sequence[RunPart],
        events: list[Event],
        losses: list[Lost],
        position: int,
        token: runtoken.RunToken,
        procs: Launcher,
        sup: Supervisor,
    ) -> None:
        self.cfg, self.rd, self.out, self.say, self.parts = cfg, rd, rd.path, say, parts
        self.events, self.losses = events, losses
        self.position = position
        """The queue position this attempt starts at (the core's checkpoint's; 0 for a new run)."""
        self.log_path = self.out / "records.msgpack"
        self.log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        """Where this attempt's records begin in the proxy's log (replayed from here after a restart)."""
        self.token, self.procs, self.sup = token, procs, sup
        self.sched = ""
        self.ports: list[int] = []
        self.core: dict[str, str] = {}
        """The core's addresses (`core.json`): its ROUTER ("core") and its weight publisher."""
        self.proxy_url = ""
        self.traj: TrajectoryService | None = None
        self.sampler: Sampler | None = None
        self.driver: Driver | None = None
        self.t_start = self.t_end = 0.0
        self.proxy_stats: dict[str, Any] = {}
        self.model_dir: Path | None = None
        self.lost: dict[int, Lost] = {}
        """Satellite cells lost on Ray in this attempt (let go), by cell id."""
        self._said_recovery: set[int] = set()
        """The losses (indices in `losses`) whose next applied step was said."""
        self.end_s: dict[str, float] = {}
        """Seconds of each part of the run's end, after its last step was applied (`metrics.json`'s
        `end_s`): the loop seeing it, the engines at the last version, the core's checkpoint of it, every
        part and process stopped, the figures, the policy's export, the samples and the timeline."""
        self._lap_at = 0.0

    def _lap(self, part: str) -> None:
        """`part` of the run's end took the seconds since the previous lap."""
        now = time.monotonic()
        self.end_s[part] = round(now - self._lap_at, 3)
        self._lap_at = now

    # ---- build --------------------------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        cfg: Config,
        rd: RunDir,
        say: Callable[[str], None],
        parts: Sequence[RunPart],
        events: list[Event],
        losses: list[Lost],
    ) -> Attempt:
        """The run directory lined up with the checkpoint, the run token, the launcher and the supervisor;
        with `[eval] tasks`, the held-out evaluator rides along; the per-step log (`runlog.RunLog`) always."""
        if cfg.eval.tasks and not any(isinstance(p, Evaluator) for p in parts):
            parts = [Evaluator(cfg), *parts]
        parts = [*parts, RunLog(cfg, say)]
        at = prepare(rd.path, rd.attempt)
        if rd.attempt:
            say(
                f"gyre run: attempt {rd.attempt} resumes {rd.path} at step {at.position} (version {at.version})"
            )
        c, sv = cfg.run, cfg.survive
        token = runtoken.install()  # $GYRE_TOKEN: every child inherits it, every link carries it
        logs = rd.path / "logs"
        procs: Launcher = (
            NodeLauncher(logs, Path(c.nodes_dir), c.node_agents, c.bind_host, c.startup_timeout_s)
            if c.node_agents
            else launcher_for(c, logs, parts_of(cfg), token_made=token.made)
        )
        # parts placed by Ray are not restarted in place: supervision watches this host's processes only
        group = procs if isinstance(procs, ProcessGroup) else procs.local
        sup = Supervisor(group, sv.max_restarts, sv.backoff_s, say, sv.restart and group is procs, events)
        if isinstance(procs, RayLauncher):  # a new attempt places every part again (a lost node's too)
            sup.attempts = sv.restart
        return cls(cfg, rd, say, parts, events, losses, at.position, token, procs, sup)

    # ---- start --------------------------------------------------------------------------------------
    def start(self) -> None:
        """Every process of the run, and in this process the trajectory service and the sampler, until
        every cell is registered with gyre-sched and the proxy answers."""
        c = self.cfg.run
        model_dir = self.model_dir = ensure_model(self.cfg, self.out, self.procs.local)
        self._start_sched()
        self.ports = [self.procs.free_port(f"cell-{i}") for i in range(c.cells)]
        self.say(f"gyre run: policy {c.policy}, {c.cells} cells, {c.steps} steps -> {self.out}")
        self._start_cells(model_dir)
        self.traj = TrajectoryService(
            self.core["core"], self.sched, self.cfg.batch.queries, streaming=self.cfg.streams,
            token_budget=self.cfg.train.token_budget, j_max=self.cfg.train.j_max,
            report_s=self.cfg.driver.report_s, first_step=self.position,
            on_closed=ledger.Ledger(self.out, self.rd.attempt).closed,
        )  # fmt: skip
        self._start_proxy(model_dir, self.traj)
        engines = {i: f"http://{self.procs.host(f'cell-{i}')}:{p}" for i, p in enumerate(self.ports)}
        self.sampler = Sampler(self.sched, engines, core=self.core["core"])
        self.sampler.start()
        self._wait(
            "the cells (engines up, registered with gyre-sched)", self._registered, c.startup_timeout_s
        )
        self._wait("gyre-proxy", lambda: proxy_up(self.proxy_url), c.startup_timeout_s)
        self.say(f"gyre run: {c.cells} cells registered, proxy at {self.proxy_url}; rollout starts")

    def _start_sched(self) -> None:
        s = self.cfg.sched
        self.sched = f"tcp://{self.procs.host('sched')}:{self.procs.free_port('sched')}"
        self.procs.start(
            "sched",
            python_argv(
                "gyre_sched.cli", "serve", "--bind", self.sched, "--policy", self.cfg.run.policy,
                "--async-train-cells", str(s.async_train_cells), "--ready-fraction", str(s.ready_fraction),
                "--hold-s", str(s.hold_s), "--timeout-h", str(self.cfg.agent.timeout_s / 3600.0),
                "--train-complete-steps" if s.train_complete_steps else "--no-train-complete-steps",
                "--heartbeat-s", str(s.heartbeat_s), "--failure-timeout-s", str(s.failure_timeout_s),
                "--switch-timeout-s", str(s.switch_timeout_s), "--drain-timeout-s", str(s.drain_timeout_s),
            ),
        )  # fmt: skip

    def _start_cells(self, model_dir: Path) -> None:
        """Every cell at once, each satellite watched by the supervisor (a satellite takes the core's
        addresses from the `core.json` the core writes, so their engines load side by side); then the
        core's addresses."""
        self._start_cell(model_dir, 0)
        for i in range(1, self.cfg.run.cells):
            start = partial(self._start_cell, model_dir, i)
            start()
            self.sup.watch(
                f"cell-{i}",
                partial(_restart_cell, self.out, i, start),
                partial(lambda i: _cell_back(self.out, i, self.sampler), i),
            )
        self._wait(
            "the core cell", (self.out / "core.json").exists, self.cfg.run.startup_timeout_s, self.procs.check
        )
        self.core = json.loads((self.out / "core.json").read_text())

    def _start_cell(self, model_dir: Path, i: int) -> None:
        cfg, c = self.cfg, self.cfg.run
        a = CellArgs(
            sched=self.sched, cell_id=i, is_core=i == 0, capacity=cfg.cell.capacity, model_dir=str(model_dir),
            engine_port=self.ports[i], run_dir=str(self.out), lr=cfg.train.lr,
            token_budget=cfg.train.token_budget, chunk_budget=cfg.train.chunk_budget, loss=cfg.train.loss,
            temperature=cfg.agent.temperature,
            tis_cap=cfg.train.tis_cap, mismatch_warn=cfg.train.mismatch_warn,
            release_memory=cfg.cell.release_memory, startup_timeout_s=c.startup_timeout_s,
            device=cfg.cell.device, engine_argv=tuple(gpus.engine_argv(cfg)),
            host=self.procs.host(f"cell-{i}"), engine=cfg.cell.engine, sglang_module=cfg.cell.sglang_module,
            checkpoint=str(self.out / CHECKPOINT) if i == 0 and cfg.checkpoints else "",
            keep_batches=str(self.out / "batches") if i == 0 and cfg.train.keep_batches else "",
            tensor_parallel=cfg.cell_shape(i)[0], pipeline_parallel=cfg.cell_shape(i)[1],
            model_backend=cfg.cell.model_backend, trains=cfg.satellite_refusal(i) is None,
            warmup=cfg.cell.warmup,
        )  # fmt: skip
        (self.out / "cells" / f"{i}.up").unlink(missing_ok=True)
        self.procs.start(
            f"cell-{i}",
            python_argv("gyre.cli", "cell", "--args", json.dumps(a.__dict__)),
            env=gpus.cell_env(cfg, i),
        )

    def _start_proxy(self, model_dir: Path, traj: TrajectoryService) -> None:
        host = self.procs.host("proxy")
        self.proxy_url = f"http://{host}:{self.procs.free_port('proxy')}"
        argv = python_argv(
            "gyre_proxy.cli", "serve", "--tokenizer", str(model_dir), "--port", self.proxy_url.rsplit(":", 1)[1],
            "--host", host, *(["--allow-remote"] if host != LOOPBACK else []),
            "--sched", self.sched, "--record-log", str(self.log_path), "--record-push", traj.address,
            "--pick-wait", str(self.cfg.proxy.pick_wait_s), "--drain-grace", str(self.cfg.proxy.drain_grace_s),
            "--kv-transport", self.cfg.proxy.kv_transport,
        )  # fmt: skip
        self.procs.start("proxy", argv)
        self.sup.watch(
            "proxy",
            partial(_restart_proxy, self.procs, argv, self.log_path, self.log_start, traj),
            lambda: proxy_up(self.proxy_url),
        )

    def _registered(self) -> bool:
        st = self.sampler.last_state if self.sampler else None
        return st is not None and len(st.cells) == self.cfg.run.cells

    def _healthy(self) -> None:
        if isinstance(self.procs, RayLauncher):
            try:
                self.procs.check()
            except PartLost as exc:
                self._lose(self.procs, exc)
        check_health(self.procs, self.traj, self.driver, self.sampler, self.sup, set(self.lost))

    def _lose(self, procs: RayLauncher, exc: PartLost) -> None:
        """A lost satellite cell is let go (the run goes on with the cells left); any other lost part
        ends the attempt (RestartAttempt, or RunError with restarts off)."""
        name = exc.part
        cell = int(name.split("-", 1)[1]) if name.startswith("cell-") else 0
        now = time.time()
        rec = Lost(
            part=name, node_id=exc.node_id, why=str(exc).splitlines()[0], alive_at=exc.alive_at,
            seen_at=now, detect_s=round(now - exc.alive_at, 3),
            applied_at_loss=self.traj.applied if self.traj is not None else 0, attempt=self.rd.attempt,
        )  # fmt: skip
        self.losses.append(rec)
        if cell == 0 or self.traj is None:  # the core, gyre-sched or the proxy; or a loss while starting
            procs.let_go(name)
            fatal = RestartAttempt if self.sup.new_attempts() else RunError
            what = " (the trainer core)" if name == "cell-0" else ""
            raise fatal(
                f"{name}{what} was lost on Ray: {exc}; the run continues from the core's checkpoint "
                f"(`gyre run --resume {self.out}`)"
            ) from exc
        procs.let_go(name)
        self.lost[cell] = rec
        self.say(f"gyre run: {name} was lost ({str(exc).splitlines()[0]}); the run goes on without it")

    def _wait(
        self, what: str, ok: Callable[[], bool], timeout_s: float, check: Callable[[], None] | None = None
    ) -> None:
        """Until `ok()`, checking the run's health (or `check`) meanwhile; RunError after `timeout_s`."""
        check = check or self._healthy
        deadline = time.monotonic() + timeout_s
        while not ok():
            check()
            if time.monotonic() > deadline:
                raise RunError(f"{what} not ready within {timeout_s:.0f} s")
            time.sleep(0.2)

    # ---- watch --------------------------------------------------------------------------------------
    def watch(self) -> None:
        """The parts and the driver started, then the run watched until its last step is applied and
        served by every rollout engine (or it fails, or passes its deadline)."""
        c = self.cfg.run
        traj, sampler = self.traj, self.sampler
        assert traj is not None and sampler is not None, "start() comes first"
        traj.start()
        driver = self.driver = Driver(
            self.cfg, self.proxy_url, self.sched, traj, sim.durations(self.cfg),
            first_step=self.position, attempt=self.rd.attempt,
        )  # fmt: skip
        ctx = RunContext(self.cfg, self.out, self.proxy_url, driver, traj, sampler, self.core["publisher"])
        for rider in self.parts:
            rider.start(ctx)
        self.t_start = time.time()
        driver.start()
        deadline = time.monotonic() + c.deadline_s
        last_say, applied = 0.0, -1
        while True:
            self._healthy()
            if traj.applied != applied:
                applied = traj.applied
                self._say_recoveries()
            for rider in self.parts:
                rider.tick(ctx)
            if traj.applied >= c.steps and driver.done.is_set() and all(p.done() for p in self.parts):
                break
            if time.monotonic() > deadline:
                self.t_end = time.time()  # what ran until now is measured up to here
                self.proxy_stats = _proxy_stats(self.proxy_url)
                raise DeadlinePassed(f"the run did not finish within [run] deadline_s = {c.deadline_s:.0f} s")
            if time.monotonic() - last_say > 5.0:
                last_say = time.monotonic()
                self.say(_progress(self.t_start, driver, traj, sampler, self.out))
            time.sleep(0.1)
        self.t_end = _last_step_end(self.out)
        self._lap_at = time.monotonic()
        self.end_s = {"seen": round(max(0.0, time.time() - self.t_end), 3)}  # the last step's end to here
        self._say_recoveries()  # the last step's line may have come after its count
        final = traj.version  # from the same core status as `applied`; below `steps` if any was skipped
        self._wait(
            "the last weight version on every rollout engine",
            lambda: engines_serve(sampler.samples, final, gone=set(self.lost)),
            60.0 + (c.startup_timeout_s if self.sup.pending() else 0.0),
        )
        self._lap("engines_at_last_version")
        if self.cfg.checkpoints:
            self._wait(
                "the core's checkpoint of the last weight version",
                lambda: policy.checkpoint_version(self.out / CHECKPOINT) == final,
                60.0,
            )
            self._lap("checkpoint")
        self.proxy_stats = _proxy_stats(self.proxy_url)
        self.say(_progress(self.t_start, driver, traj, sampler, self.out))

    def _say_recoveries(self) -> None:
        """Says, once each, how long after a loss was seen the next step was applied."""
        for k, rec in enumerate(_losses(self.losses, self.out)):
            if k not in self._said_recovery and rec["next_step_at"] is not None:
                self._said_recovery.add(k)
                self.say(
                    f"gyre run: the first step after {rec['part']}'s loss was applied "
                    f"{rec['seen_to_step_s']:.1f} s after the loss was seen ({rec['recovery_s']:.1f} s after "
                    f"its last answer, attempt {self.rd.attempt})"
                )

    def stop(self) -> None:
        """Every part, the driver, the trajectory service and the sampler stopped, every child process
        stopped, the run token uninstalled (also after an error)."""
        for rider in self.parts:
            rider.stop()
        for part in (self.driver, self.traj, self.sampler):
            if part is not None:
                part.stop()
        self.procs.close()
        self.token.uninstall()
        if self.end_s:  # after the last step: part of the run's end
            self._lap("stop")

    # ---- collect ------------------------------------------------------------------------------------
    def _measured(self, t_end: float) -> dict[str, Any]:
        """The attempt's figures from its first batch to `t_end`."""
        driver, traj, sampler, out = self.driver, self.traj, self.sampler, self.out
        assert driver is not None and traj is not None and sampler is not None
        summaries = {int(r["step"]): r for r in ledger.read(out / ledger.LEDGER)}  # earlier attempts'
        summaries.update({k: sd.summary for k, sd in traj.steps.items()})
        metrics = runmetrics.collect(
            self.cfg, out, self.t_start, t_end, driver.outcomes(), summaries, traj.records,
            traj.dropped, sampler,
        )  # fmt: skip
        metrics["moves"] = _moves(self.proxy_stats)
        metrics["efficiency"] = efficiency.efficiency(
            self.cfg, out, (c for _, c in recordlog.calls(self.log_path)), sampler.samples, sampler.training(),
            self.t_start, t_end,
        )  # fmt: skip
        return metrics

    def collect_partial(self, why: str) -> None:
        """What an attempt stopped at its deadline did, up to then: `metrics-partial.json` (the figures of
        `metrics.json` over the time it ran, `partial` saying why it stopped), its samples and
        `timeline-partial.png`. The run stays failed (`--resume` continues it). Never raises: the
        deadline is the error to report."""
        if self.driver is None or self.traj is None or self.sampler is None or not self.t_start:
            return
        try:
            metrics = {"partial": why, **self._measured(self.t_end)}
            write_json(self.out / "metrics-partial.json", metrics)
            self._write_samples()
            write_plot(
                metrics, self.sampler.samples, self.sampler.training(), self.out / "timeline-partial.png"
            )
            self.say(f"gyre run: what ran before the deadline is in {self.out / 'metrics-partial.json'}")
        except Exception as exc:  # the figures of a run cut short are a help, not a requirement
            log.warning("the partial metrics could not be written: %s: %s", type(exc).__name__, exc)

    def _write_samples(self) -> None:
        assert self.sampler is not None
        with open(self.out / "samples.jsonl", "w") as fh:
            for smp in self.sampler.samples:
                fh.write(json.dumps(smp.__dict__) + "\n")
        with open(self.out / "train-samples.jsonl", "w") as fh:
            for ts in self.sampler.training().samples:
                fh.write(json.dumps(ts.__dict__) + "\n")

    def collect(self) -> dict[str, Any]:
        """`metrics.json`, the samples and the plot of the finished attempt; the run marked finished."""
        traj, sampler, out = self.traj, self.sampler, self.out
        assert traj is not None and sampler is not None
        metrics = self._measured(self.t_end)
        self._lap("figures")
        metrics["attempt"] = self.rd.attempt
        metrics["attempts"] = (
            self.rd.attempt + 1
        )  # attempts of the run so far, resumes and new attempts included
        metrics["survival"] = {
            "events": [e.to_dict() for e in self.events],
            "lost": _losses(self.losses, out),
        }
        metrics["accounting"] = ledger.account(out, traj.applied).to_dict()
        assert self.model_dir is not None
        metrics["policy_dir"] = None
        if not self.cfg.checkpoints:
            self.say("gyre run: the trained policy was not exported: the core's model is split over "
                     "pipeline stages, which gyre-train does not checkpoint")  # fmt: skip
        else:
            try:
                metrics["policy_dir"] = str(
                    policy.export(out / CHECKPOINT, out / policy.POLICY, self.model_dir)
                )
            except policy.NotExported as exc:  # the run is done: it is said, not lost
                self.say(f"gyre run: the trained policy was not exported: {exc}")
            self._lap("export")
        self._write_samples()
        self._lap("samples")
        plot = write_plot(metrics, sampler.samples, sampler.training(), out / "timeline.png")
        self._lap("plot")
        metrics["end_s"] = dict(self.end_s)
        write_json(out / "metrics.json", metrics)
        self.say(
            f"gyre run: done in {metrics['end_to_end_s']:.1f} s; idle rollout {metrics['roles']['idle_rollout']}, "
            f"idle training {metrics['roles']['idle_training']}, switches {metrics['switches']}; "
            f"metrics {out / 'metrics.json'}" + (f", plot {plot}" if plot else "")
        )
        self.rd.mark("finished")
        return metrics


def check_health(
    procs: Launcher,
    traj: TrajectoryService | None,
    driver: Driver | None,
    sampler: Sampler | None,
    sup: Supervisor | None = None,
    lost: Collection[int] = (),
) -> None:
    """Raise (ChildDied, RunError or, when supervising, RestartAttempt; naming the part and why) if any
    part of the run has failed and cannot be restarted in place; restart those that can (`sup`). Cells
    in `lost` (let go: the run goes on without them) may be failed by gyre-sched."""
    if sup is not None:
        sup.check()
    else:
        procs.check()
    fatal = RestartAttempt if sup is not None and sup.new_attempts() else RunError
    why = traj.failure() if traj is not None else None
    if traj is not None and why is not None:
        raise fatal(f"the trajectory service failed: {why}") from traj.error
    if driver is not None and driver.error is not None:
        raise fatal(f"the rollout driver failed: {driver.error}") from driver.error
    st = sampler.last_state if sampler is not None else None
    failed = [
        v for v in (st.cells if st is not None else ()) if v.role is Role.FAILED and v.cell_id not in lost
    ]
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


def _losses(lost: Sequence[Lost], out: Path) -> list[dict[str, Any]]:
    """The lost parts (`Lost`), each with `next_step_at`, the first step applied after its actor's last
    answer (None: no step was left; after a lost core, the first the next attempt applied), `recovery_s`,
    from that answer to it, and `seen_to_step_s`, from the loss seen to it."""
    ends = sorted(float(r["t_end"]) for r in read_steps(out))
    recs = []
    for rec in lost:
        after = rec.seen_at if rec.part in ("cell-0", "sched", "proxy") else rec.alive_at
        nxt = next((t for t in ends if t > after), None)
        recs.append(
            {
                **asdict(rec),
                "next_step_at": nxt,
                "recovery_s": round(nxt - rec.alive_at, 3) if nxt is not None else None,
                "seen_to_step_s": round(nxt - rec.seen_at, 3) if nxt is not None else None,
            }
        )
    return recs


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
    skipped = sum(bool(r.get("skipped")) for r in read_steps(out))
    host = hostmem.summary(out / "logs" / PIDS)
    return (
        f"[{time.time() - t0:6.1f}s] executions running {running}, finished {finished}; records {traj.records}; "
        f"steps handed to the trainer {traj.steps_closed}, applied {traj.applied}"
        + (f" ({skipped} skipped: nothing to train)" if skipped else "")
        + f"; cells {roles}"
        + (f"; {host}" if host else "")
    )


def _last_step_end(out: Path) -> float:
    rows = read_steps(out)
    if not rows:
        raise RunError("the core reported no step")
    return float(rows[-1]["t_end"])


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
