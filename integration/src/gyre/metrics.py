"""What a run measured: a sampler of cell roles and engine activity, the metrics JSON and the timeline plot.

The sampler asks gyre-sched for its state (`GetState`: every cell's role, the decision log) and each
engine for its load every `interval_s` (`EngineClient.load`: gyre-engine's counters from its
`/server_info`; for SGLang, whose `/server_info` is its configuration, `/v1/loads` and `/model_info`). Afterwards, per cell: time in each role; rollout time is
busy while its engine runs or queues a request; training time is busy while a training step is in
progress at the core (from the core's `steps.jsonl`); the rest is idle; draining and switching count as
switching. Plus end-to-end time, switches (the scheduler's decisions), staleness and loss per step.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
from gyre_engine.client import EngineClient
from gyre_sched.protocol import Codec, GetState, Hello, PeerKind, Role, State

log = logging.getLogger("gyre.metrics")


@dataclass
class Sample:
    t: float
    roles: dict[int, int]
    engine_busy: dict[int, bool]
    """The engine ran or queued a request at this sample, or computed anything since the last one."""
    engine_version: dict[int, str]


@dataclass
class Sampler:
    sched_address: str
    engines: dict[int, str]
    interval_s: float = 0.2
    samples: list[Sample] = field(default_factory=list)
    last_state: State | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30.0)

    def state(self, sock: zmq.Socket[bytes], codec: Codec) -> State | None:
        sock.send(codec.encode(GetState()))
        deadline = time.monotonic() + 5.0
        while sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            msg = codec.decode(sock.recv())
            if isinstance(msg, State):
                return msg
            if time.monotonic() > deadline:
                break
        return None

    async def _run(self) -> None:
        codec = Codec()
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.sched_address)
        sock.send(codec.encode(Hello(PeerKind.OBSERVER)))
        clients = {cid: EngineClient(url, timeout_s=5.0) for cid, url in self.engines.items()}
        work: dict[int, int] = {}
        try:
            while not self._stop.is_set():
                st = self.state(sock, codec)
                if st is not None:
                    self.last_state = st
                    busy, ver = await engine_activity(clients, work)
                    self.samples.append(
                        Sample(time.time(), {v.cell_id: int(v.role) for v in st.cells}, busy, ver)
                    )
                await asyncio.sleep(self.interval_s)
        finally:
            for c in clients.values():
                await c.aclose()
            sock.close(0)
            ctx.term()


async def engine_activity(
    clients: dict[int, EngineClient], work: dict[int, int]
) -> tuple[dict[int, bool], dict[int, str]]:
    """Per engine: busy (a request running or queued, or its work counter moved since the last reading,
    kept in `work`) and its weight version. An engine that does not answer is left out: idle."""
    busy: dict[int, bool] = {}
    ver: dict[int, str] = {}
    for cid, c in clients.items():
        try:
            load = await c.load()
        except Exception:  # a busy or restarting engine: this sample says idle
            continue
        busy[cid] = load.running + load.waiting > 0 or load.work != work.get(cid, load.work)
        work[cid] = load.work
        ver[cid] = load.weight_version
    return busy, ver


SWITCHING = {int(Role.DRAINING), int(Role.TO_TRAINING), int(Role.TO_ROLLOUT)}


def _in_steps(t: float, intervals: list[tuple[float, float]]) -> bool:
    return any(a <= t <= b for a, b in intervals)


def role_accounting(
    samples: list[Sample], step_intervals: list[tuple[float, float]], t0: float, t1: float
) -> dict[str, Any]:
    """Per cell and in total: seconds in rollout / training / switching, and the idle share of each."""
    per_cell: dict[int, dict[str, float]] = {}
    for prev, cur in itertools.pairwise(samples):
        if cur.t < t0 or prev.t > t1:
            continue
        dt = min(cur.t, t1) - max(prev.t, t0)
        if dt <= 0:
            continue
        for cid, role in prev.roles.items():
            busy = cur.engine_busy.get(cid, False) or prev.engine_busy.get(cid, False)
            acc = per_cell.setdefault(
                cid, {"rollout_s": 0.0, "rollout_busy_s": 0.0, "training_s": 0.0, "training_busy_s": 0.0,
                      "switching_s": 0.0, "failed_s": 0.0}
            )  # fmt: skip
            if role == int(Role.ROLLOUT):
                acc["rollout_s"] += dt
                if busy:
                    acc["rollout_busy_s"] += dt
            elif role == int(Role.TRAINING):
                acc["training_s"] += dt
                if _in_steps(prev.t, step_intervals):
                    acc["training_busy_s"] += dt
            elif role in SWITCHING:
                acc["switching_s"] += dt
            else:
                acc["failed_s"] += dt
    tot = {k: sum(c[k] for c in per_cell.values()) for k in
           ("rollout_s", "rollout_busy_s", "training_s", "training_busy_s", "switching_s", "failed_s")}  # fmt: skip
    all_s = sum(tot[k] for k in ("rollout_s", "training_s", "switching_s", "failed_s"))

    def share(idle: float, total: float) -> float | None:
        return round(idle / total, 4) if total > 0 else None

    out: dict[str, Any] = {
        "idle_rollout": share(tot["rollout_s"] - tot["rollout_busy_s"], tot["rollout_s"]),
        "idle_training": share(tot["training_s"] - tot["training_busy_s"], tot["training_s"]),
        "switching_share": share(tot["switching_s"], all_s),
        "idle_total": share(all_s - tot["rollout_busy_s"] - tot["training_busy_s"], all_s),
        "cell_seconds": {k: round(v, 3) for k, v in tot.items()},
        "per_cell": {
            str(cid): {k: round(v, 3) for k, v in acc.items()} for cid, acc in sorted(per_cell.items())
        },
    }
    return out


def write_plot(metrics: dict[str, Any], samples: list[Sample], path: Path) -> Path | None:
    """Timeline PNG: one row per cell, colour = role (dark = busy), a line per applied step."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("no plot: matplotlib is not installed (pip install 'gyre-sched[plot]')")
        return None
    t0 = metrics["t0"]
    steps = [(s["t_start"], s["t_end"]) for s in metrics["steps"] if "t_end" in s]
    fig, ax = plt.subplots(figsize=(10, 1.0 + 0.6 * max(1, len(metrics["roles"]["per_cell"]))))
    colours = {
        ("r", True): "#1f77b4", ("r", False): "#aec7e8", ("t", True): "#d62728", ("t", False): "#ff9896",
        ("s", True): "#7f7f7f", ("s", False): "#7f7f7f",
    }  # fmt: skip
    for prev, cur in itertools.pairwise(samples):
        for cid, role in prev.roles.items():
            if role == int(Role.ROLLOUT):
                key = ("r", cur.engine_busy.get(cid, False) or prev.engine_busy.get(cid, False))
            elif role == int(Role.TRAINING):
                key = ("t", _in_steps(prev.t, steps))
            else:
                key = ("s", True)
            ax.broken_barh([(prev.t - t0, cur.t - prev.t)], (cid - 0.4, 0.8), color=colours[key], linewidth=0)
    for s in metrics["steps"]:
        if "t_end" in s:
            ax.axvline(s["t_end"] - t0, color="k", linewidth=0.8, linestyle=":")
    ax.set_xlim(0, metrics["end_to_end_s"] * 1.02 + 0.1)
    ax.set_xlabel("seconds since the first batch started")
    ax.set_ylabel("cell")
    ax.set_yticks(sorted({cid for smp in samples for cid in smp.roles}))
    ax.set_title(
        f"{metrics['policy']}: {metrics['end_to_end_s']:.1f} s; rollout (blue), training (red), "
        "switching (grey); light = idle"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    tmp.rename(path)
