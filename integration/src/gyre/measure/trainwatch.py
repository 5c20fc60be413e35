"""What gyre-train's core was doing, sampled often enough to see one micro-batch, and how much training
overlapped the rollout of the batch it trained.

`TrainWatch` asks the core for its status every `interval_s` (0.05 s; a status round trip costs well
under a millisecond) on its own thread and keeps a `TrainSample` each time: the step the core is
training and whether it had work in hand (micro-batches queued or being computed, or its update being
applied). `TrainTrack` reads those samples as a piecewise-constant state (each sample holds until the
next); `train_overlap` combines it with the cells' roles (gyre-sched's, sampled by `metrics.Sampler`)
and the driver's outcomes into busy training cell-seconds, and the share of them spent while the step's
own batch still had unfinished executions.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from gyre_sched.protocol import Role
from gyre_train.control import ControlError, CoreClient

from gyre.measure.samples import Sample

log = logging.getLogger("gyre.trainwatch")
TRAINING = int(Role.TRAINING)


@dataclass(frozen=True)
class TrainSample:
    t: float
    step: int
    """The step the core is training (its queue position); -1: none."""
    busy: bool
    """That step had micro-batches queued or being computed, or its update was being applied."""
    done: int = 0
    """That step's micro-batches with their gradient in (`StepInfo.done`)."""
    version: int = 0
    """The core's weight version (a step taken with no version change was skipped, not trained)."""


def sample_status(core: CoreClient) -> TrainSample:
    """One sample of the core's status (an unanswered status says idle)."""
    t = time.time()
    try:
        st = core.status()
    except ControlError:
        return TrainSample(t, -1, False)
    for info in st.steps:
        if info.training:
            applying = info.closed and info.microbatches > 0 and info.done == info.microbatches
            busy = info.queued + info.claimed > 0 or applying
            return TrainSample(t, info.seq, busy, info.done, st.version)
    if st.steps:  # none in progress: the oldest step's count still tells `credit_done` what got done
        return TrainSample(t, st.steps[0].seq, False, st.steps[0].done, st.version)
    return TrainSample(t, st.queue_position, False, 0, st.version)


def credit_done(samples: Sequence[TrainSample]) -> list[TrainSample]:
    """Samples with every interval in which micro-batches were completed counted busy for their step: a
    micro-batch computed between two samples (a tiny model trains one in milliseconds) is otherwise
    never seen in progress. Sample i holds until sample i + 1; if sample i + 1 shows more of step k done
    than any earlier sample, interval i was busy on step k; if it shows a later step and a newer weight
    version, interval i was busy on sample i's step (applied in between; a step skipped for having
    nothing to train moves the step on but not the version, and counts for nothing)."""
    out = list(samples)
    seen: dict[int, int] = {}
    for i in range(1, len(out)):
        x, prev = out[i], out[i - 1]
        if x.step >= 0 and x.done > seen.get(x.step, 0):
            seen[x.step] = x.done
            if not prev.busy:
                out[i - 1] = replace(
                    prev, step=x.step, busy=True, done=prev.done if prev.step == x.step else 0
                )
        elif 0 <= prev.step < x.step and x.version > prev.version and not prev.busy:
            out[i - 1] = replace(prev, busy=True)
    return out


class TrainWatch:
    def __init__(self, core: str, interval_s: float = 0.05) -> None:
        self.core = core
        self.interval_s = interval_s
        self.samples: list[TrainSample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="train-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout=10.0)

    def _run(self) -> None:
        client = CoreClient(self.core, timeout_s=2.0)
        try:
            while not self._stop.is_set():
                self.samples.append(sample_status(client))
                self._stop.wait(self.interval_s)
        finally:
            client.close()


class TrainTrack:
    """Train samples as a piecewise-constant state: sample i holds from its time to sample i + 1's."""

    def __init__(self, samples: Sequence[TrainSample]) -> None:
        self.samples = credit_done(samples)
        self.times = [s.t for s in self.samples]

    def segments(self, a: float, b: float) -> Iterator[tuple[float, float, TrainSample]]:
        """(start, duration, state) of each constant piece inside [a, b) (before the first sample: none)."""
        i = max(0, bisect.bisect_right(self.times, a) - 1)
        n = len(self.samples)
        while i < n and self.times[i] < b:
            s = max(a, self.times[i])
            e = min(b, self.times[i + 1]) if i + 1 < n else b
            if e > s:
                yield s, e - s, self.samples[i]
            i += 1

    def busy_s(self, a: float, b: float) -> float:
        return sum(dt for _, dt, x in self.segments(a, b) if x.busy)


def train_overlap(
    samples: list[Sample], track: TrainTrack, outcomes: list[dict[str, Any]], t0: float, t1: float
) -> dict[str, Any]:
    """Busy training cell-seconds within [t0, t1] (cells in gyre-sched's TRAINING role while the core's
    step had work in hand), in all and per step, and those during which that step's own batch still had
    an unfinished execution (`outcomes`: the driver's, each with its step and end time).
    `train_overlap_share` is the second over the first (None without busy training). Per step also when
    its training was first seen busy and when its batch's last execution ended (wall times)."""
    last: dict[int, float] = {}
    for o in outcomes:
        k = int(o["step"])
        last[k] = max(last.get(k, 0.0), float(o["end"]))
    per_step: dict[int, dict[str, Any]] = {}
    busy = overlap = 0.0
    for prev, cur in itertools.pairwise(samples):
        # Roles are sampled every 0.2 s: a switch in and out between two role samples is not seen, but the
        # core computes only while in training, so busy training means at least one training cell.
        n = max(1, sum(r == TRAINING for r in prev.roles.values()))
        a, b = max(prev.t, t0), min(cur.t, t1)
        if b <= a:
            continue
        for s, dt, x in track.segments(a, b):
            if not x.busy or x.step < 0:
                continue
            st = per_step.setdefault(x.step, {"busy_cell_s": 0.0, "overlap_cell_s": 0.0, "train_first": s})
            st["busy_cell_s"] += n * dt
            busy += n * dt
            ov = n * min(dt, max(0.0, last.get(x.step, 0.0) - s))  # until the batch's last execution ends
            st["overlap_cell_s"] += ov
            overlap += ov
    for k, st in per_step.items():
        st["batch_end"] = last.get(k)
        st["busy_cell_s"] = round(st["busy_cell_s"], 3)
        st["overlap_cell_s"] = round(st["overlap_cell_s"], 3)
    return {
        "train_overlap_share": round(overlap / busy, 4) if busy > 0 else None,
        "busy_cell_s": round(busy, 3),
        "overlap_cell_s": round(overlap, 3),
        "per_step": {str(k): st for k, st in sorted(per_step.items())},  # keyed as in metrics.json
    }
