"""What a run measured: a sampler of cell roles, engine and trainer activity, the metrics JSON and the
timeline plot.

The sampler asks gyre-sched for its state (`GetState`: every cell's role, the decision log) and each
engine for its load every `interval_s` (`EngineClient.load`: gyre-engine's counters from its
`/server_info`; for SGLang, whose `/server_info` is its configuration, `/v1/loads` and `/model_info`), and
keeps a `trainwatch.TrainWatch` on gyre-train's core (its status every 0.05 s). Afterwards, per cell: time
in each role; rollout time is busy while its engine runs or queues a request; training time is busy while
the step in progress has micro-batches queued, being computed or being applied (the core's `StepInfo`);
the rest is idle; draining and switching count as switching. `trainwatch.train_overlap` says how much of
the busy training ran while the step's own batch still had unfinished executions (streaming's overlap).
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

import msgspec
import zmq
from gyre_engine.client import EngineClient
from gyre_sched.client import dealer
from gyre_sched.protocol import Codec, GetState, Hello, PeerKind, Role, State

from gyre.measure.samples import Sample, busy_between
from gyre.measure.trainwatch import TrainTrack, TrainWatch

log = logging.getLogger("gyre.metrics")


@dataclass
class Sampler:
    sched_address: str
    engines: dict[int, str]
    core: str = ""
    """gyre-train's core address (empty: training activity is not sampled)."""
    interval_s: float = 0.2
    samples: list[Sample] = field(default_factory=list)
    last_state: State | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _watch: TrainWatch | None = None

    def start(self) -> None:
        if self.core:
            self._watch = TrainWatch(self.core)
            self._watch.start()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()
        if self._thread is not None:
            self._thread.join(timeout=30.0)

    def training(self) -> TrainTrack:
        """What the core was doing (empty without a core address)."""
        return TrainTrack(self._watch.samples if self._watch is not None else [])

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
        sock = dealer(ctx, self.sched_address)  # with the run token ($GYRE_TOKEN) when there is one
        sock.send(codec.encode(Hello(PeerKind.OBSERVER)))
        clients = {cid: EngineClient(url, timeout_s=5.0) for cid, url in self.engines.items()}
        work: dict[int, int] = {}
        try:
            while not self._stop.is_set():
                st = self.state(sock, codec)
                if st is not None:
                    self.last_state = st
                    busy, ver, counters = await engine_activity(clients, work)
                    self.samples.append(
                        Sample(time.time(), {v.cell_id: int(v.role) for v in st.cells}, busy, ver, counters)
                    )
                await asyncio.sleep(self.interval_s)
        finally:
            for c in clients.values():
                await c.aclose()
            sock.close(0)
            ctx.term()


async def engine_activity(
    clients: dict[int, EngineClient], work: dict[int, int]
) -> tuple[dict[int, bool], dict[int, str], dict[int, dict[str, float | None]]]:
    """Per engine: busy (a request running or queued, or its work counter moved since the last reading,
    kept in `work`), its weight version, and its cumulative counters with its waiting requests (where it
    reports them). An engine that does not answer is left out: idle."""
    busy: dict[int, bool] = {}
    ver: dict[int, str] = {}
    counters: dict[int, dict[str, float | None]] = {}
    for cid, c in clients.items():
        try:
            load = await c.load()
        except Exception:  # a busy or restarting engine: this sample says idle
            continue
        busy[cid] = load.running + load.waiting > 0 or load.work != work.get(cid, load.work)
        work[cid] = load.work
        ver[cid] = load.weight_version
        if load.counters is not None:
            counters[cid] = {**msgspec.structs.asdict(load.counters), "waiting": load.waiting}
    return busy, ver, counters


SWITCHING = {int(Role.DRAINING), int(Role.TO_TRAINING), int(Role.TO_ROLLOUT)}


def role_accounting(samples: list[Sample], track: TrainTrack, t0: float, t1: float) -> dict[str, Any]:
    """Per cell and in total: seconds in rollout / training / switching, and the idle share of each."""
    per_cell: dict[int, dict[str, float]] = {}
    for prev, cur in itertools.pairwise(samples):
        if cur.t < t0 or prev.t > t1:
            continue
        dt = min(cur.t, t1) - max(prev.t, t0)
        if dt <= 0:
            continue
        for cid, role in prev.roles.items():
            busy = busy_between(prev, cur, cid)
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
                acc["training_busy_s"] += track.busy_s(max(prev.t, t0), min(cur.t, t1))
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


def write_plot(metrics: dict[str, Any], samples: list[Sample], track: TrainTrack, path: Path) -> Path | None:
    """Timeline PNG: one row per cell, colour = role (dark = busy), a dotted line per applied step; below,
    each batch's rollout (first start to last end), orange where its own step was already training."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("no plot: matplotlib is not installed (pip install 'gyre-sched[plot]')")
        return None
    t0 = metrics["t0"]
    fig, ax = plt.subplots(figsize=(10, 1.6 + 0.6 * max(1, len(metrics["roles"]["per_cell"]))))
    colours = {"r": "#1f77b4", "r-idle": "#aec7e8", "t": "#d62728", "t-idle": "#ff9896", "s": "#7f7f7f"}
    for (cid, kind), bars in sorted(role_bars(samples, track).items()):
        ax.broken_barh(
            [(a - t0, w) for a, w in bars], (cid - 0.4, 0.8), color=colours[kind], linewidth=0,
            zorder=2 if kind == "t" else 1,
        )  # fmt: skip
    for s in metrics["steps"]:
        if "t_end" in s:
            ax.axvline(s["t_end"] - t0, color="k", linewidth=0.8, linestyle=":")
    _batch_lanes(ax, metrics)
    ax.set_xlim(0, metrics["end_to_end_s"] * 1.02 + 0.1)
    ax.set_xlabel("seconds since the first batch started")
    cells = sorted({cid for smp in samples for cid in smp.roles})
    ax.set_yticks([-1.3, *cells], ["batches", *(f"cell {c}" for c in cells)])
    share = metrics.get("train_overlap_share")
    ax.set_title(
        f"{metrics['policy']}: {metrics['end_to_end_s']:.1f} s; rollout (blue), training (red), switching "
        f"(grey); light = idle" + (f"; overlap {100 * share:.0f}%" if share is not None else ""),
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def role_bars(samples: list[Sample], track: TrainTrack) -> dict[tuple[int, str], list[tuple[float, float]]]:
    """The timeline's bars: per (cell, kind) the (start, width) of each stretch of that kind, adjacent
    sample intervals of one kind merged into one bar. Kinds: "r" rollout with its engine busy, "r-idle"
    rollout idle, "t-idle" the training role, "t" the core busy within it (drawn over "t-idle"), "s"
    switching. A run sampled every 0.2 s for an hour has 18,000 intervals a cell: drawn one bar each, its
    plot had not finished after 19 minutes on a 2-core CPU (a 5-minute run's took 10-13 s at the end of
    the run); merged, it draws as many bars as the cell changed what it did."""
    spans: dict[tuple[int, str], list[list[float]]] = {}  # [start, end] of each stretch

    def add(cid: int, kind: str, a: float, b: float) -> None:
        lst = spans.setdefault((cid, kind), [])
        if lst and abs(lst[-1][1] - a) < 1e-6:  # epoch seconds: about 2e-7 s apart at float precision
            lst[-1][1] = b
        else:
            lst.append([a, b])

    for prev, cur in itertools.pairwise(samples):
        for cid, role in prev.roles.items():
            if role == int(Role.ROLLOUT):
                kind = "r" if busy_between(prev, cur, cid) else "r-idle"
            elif role == int(Role.TRAINING):
                kind = "t-idle"  # light; the busy pieces are drawn over it
                for s0, dt, x in track.segments(prev.t, cur.t):
                    if x.busy:
                        add(cid, "t", s0, s0 + dt)
            else:
                kind = "s"
            add(cid, kind, prev.t, cur.t)
    return {k: [(a, b - a) for a, b in v] for k, v in spans.items()}


def _batch_lanes(ax: Any, metrics: dict[str, Any]) -> None:
    """Batch k's rollout on lane k % 2 below the cells; orange from its step's first busy training on."""
    t0 = metrics["t0"]
    spans: dict[int, list[float]] = {}
    for o in metrics["outcomes"]:
        lo_hi = spans.setdefault(int(o["step"]), [o["start"], o["end"]])
        lo_hi[0], lo_hi[1] = min(lo_hi[0], o["start"]), max(lo_hi[1], o["end"])
    first = {
        int(k): v["train_first"] for k, v in metrics.get("train_overlap", {}).get("per_step", {}).items()
    }
    for k, (a, b) in sorted(spans.items()):
        y = -1.0 - 0.6 * (k % 2)
        ax.broken_barh([(a - t0, b - a)], (y - 0.25, 0.5), color="#c7c7c7", linewidth=0)
        f = first.get(k)
        if f is not None and f < b:
            ax.broken_barh([(f - t0, b - f)], (y - 0.25, 0.5), color="#ff7f0e", linewidth=0)
        ax.text(a - t0, y, f" b{k}", va="center", fontsize=7)


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    tmp.rename(path)
