"""Physical floors of a run's switches and weight pushes, and the run's figures set against them.

What has to move, and at what measured speed (`measure_copies`, on the machine of the run):
- **to training**: the engine's `/release_memory_occupation` moves its weights to host memory (gyre-engine's
  release: `model.to("cpu")`) and drops its KV (nothing copied); floor = weight bytes / device->host.
- **to rollout**: `/resume_memory_occupation` moves the weights back (host->device), then the cell loads
  the newest version (a push); floor = weight bytes / host->device + the push floor. CUDA graphs dropped
  by the release are captured again on first use, inside rollout, not inside the switch: they count in
  rollout throughput (`graph_recapture_s` stays 0 here).
- **a push** (the core's snapshot to an engine through gyre-xfer over shared memory): the core copies
  its parameters into the publisher's host slot (device->host), the engine pulls them into its staging
  buffer (host memcpy), then copies them into its parameters (host->device);
  floor = bytes / d2h + bytes / memcpy + bytes / h2d.
The floors use the fastest measured path of each kind (pinned host memory for device copies): what the
hardware allows, not what the code does today (the pageable figures, also measured, are what
`model.to("cpu")` gets). Goal per the issue: switch <= 2 x floor + 1 s, push <= 2 x floor + 0.5 s.
"""

from __future__ import annotations

import itertools
import statistics
import time
from pathlib import Path
from typing import Any

GB = 1e9


def measure_copies(device: str, nbytes: int, repeats: int = 5) -> dict[str, float]:
    """GB/s (medians of `repeats` after one warm-up) of copying `nbytes`: host->device and device->host
    from pinned and from pageable memory, and host memcpy. On the CPU the device copies are host copies."""
    import torch

    n = max(1, nbytes // 2)
    cuda = device.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def timed(fn: Any) -> float:
        fn()
        sync()
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            sync()
            ts.append(time.perf_counter() - t0)
        return round(2 * n / statistics.median(ts) / GB, 3)

    host = torch.empty(n, dtype=torch.bfloat16)
    host2 = torch.empty_like(host)
    host.fill_(1.0)
    out = {"bytes": float(2 * n), "memcpy_gbps": timed(lambda: host2.copy_(host))}
    if not cuda:
        out.update(h2d_pinned_gbps=out["memcpy_gbps"], d2h_pinned_gbps=out["memcpy_gbps"])
        out.update(h2d_pageable_gbps=out["memcpy_gbps"], d2h_pageable_gbps=out["memcpy_gbps"])
        return out
    dev = torch.empty(n, dtype=torch.bfloat16, device=device)
    pinned = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
    out["h2d_pinned_gbps"] = timed(lambda: dev.copy_(pinned, non_blocking=True))
    out["d2h_pinned_gbps"] = timed(lambda: pinned.copy_(dev, non_blocking=True))
    out["h2d_pageable_gbps"] = timed(lambda: dev.copy_(host))
    out["d2h_pageable_gbps"] = timed(lambda: host2.copy_(dev))
    torch.cuda.empty_cache()  # `dev` and `pinned` go with this frame
    return out


def measure_xfer(state: dict[str, Any], repeats: int = 3) -> dict[str, float]:
    """The weight push path's own speed, in this process: gyre-xfer publish (device->shared-memory slot)
    and pull (slot -> the subscriber's staging buffer), medians; GB/s of each part and of the two."""
    from gyre_xfer.publisher import Publisher
    from gyre_xfer.subscriber import Subscriber, SubscriberConfig
    from gyre_xfer.transport import Config, open_transport

    nbytes = sum(int(t.numel()) * t.element_size() for t in state.values())
    pub_s: list[float] = []
    pull_s: list[float] = []
    with (
        Publisher(open_transport(Config(kind="shm"))) as pub,
        Subscriber(open_transport(Config(kind="shm")), SubscriberConfig(publisher=pub.address)) as sub,
    ):
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            v = pub.publish(state)
            t1 = time.perf_counter()
            sub.pull(min_version=v)
            t2 = time.perf_counter()
            if i:  # the first round allocates the slot and staging buffers
                pub_s.append(t1 - t0)
                pull_s.append(t2 - t1)
    p, q = statistics.median(pub_s), statistics.median(pull_s)
    return {
        "bytes": float(nbytes),
        "publish_s": round(p, 4),
        "pull_s": round(q, 4),
        "publish_gbps": round(nbytes / p / GB, 3),
        "pull_gbps": round(nbytes / q / GB, 3),
        "push_gbps": round(nbytes / (p + q) / GB, 3),
    }


def floors(weight_bytes: float, bw: dict[str, float], graph_recapture_s: float = 0.0) -> dict[str, float]:
    """The floors (module docstring) from the weight bytes and `measure_copies`' figures."""
    w = weight_bytes / GB
    push = w / bw["d2h_pinned_gbps"] + w / bw["memcpy_gbps"] + w / bw["h2d_pinned_gbps"]
    return {
        "weight_bytes": weight_bytes,
        "floor_to_training_s": round(w / bw["d2h_pinned_gbps"], 4),
        "floor_to_rollout_s": round(w / bw["h2d_pinned_gbps"] + push + graph_recapture_s, 4),
        "push_floor_s": round(push, 4),
        "graph_recapture_s": graph_recapture_s,
    }


def weight_bytes(model_dir: str | Path) -> int:
    """Bytes of the model's tensors (the safetensors files' payloads)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open has no __iter__
                sl = st.get_slice(name)
                n = 1
                for d in sl.get_shape():
                    n *= int(d)
                total += n * _dtype_bytes(sl.get_dtype())
    return total


def _dtype_bytes(name: str) -> int:
    return {"F32": 4, "BF16": 2, "F16": 2, "F64": 8, "I64": 8, "I32": 4}.get(name, 4)


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def step_train_figures(steps: list[dict[str, Any]]) -> dict[str, float | None]:
    """The first applied step's training seconds and the median of the later ones', from a run's steps:
    metrics.json's `steps` (busy training cell-seconds, sampled: a streamed step's wall time includes its
    waits for groups) or the core's steps.jsonl lines (wall seconds, `elapsed_s`, where nothing sampled
    them, or where sampling saw none: a step shorter than the sampling interval). Skipped steps
    (nothing to train) do not count; None where there is no such step."""
    secs = [float(s.get("busy_cell_s") or s["elapsed_s"]) for s in steps if not s.get("skipped")]
    return {
        "first_step_train_s": round(secs[0], 3) if secs else None,
        "later_step_train_s_median": round(statistics.median(secs[1:]), 3) if len(secs) > 1 else None,
    }


def run_figures(metrics: dict[str, Any], output_tokens: int) -> dict[str, Any]:
    """What the run itself measured (`gyre run`'s metrics.json): median switch times, push times per
    version, rollout tokens/s per busy rollout cell-second and per second of the run (`output_tokens`:
    every recorded call's), training tokens/s per busy training cell-second (the steps' trained tokens),
    and the first step's training seconds against the later steps' (`step_train_figures`)."""
    sw = metrics.get("switch_times", {})
    steps = [s for s in metrics.get("steps", []) if not s.get("skipped")]
    cs = metrics.get("roles", {}).get("cell_seconds", {})
    roll_busy = float(cs.get("rollout_busy_s") or 0.0)
    train_busy = sum(float(s.get("busy_cell_s") or 0.0) for s in steps)
    train_tokens = sum(int(s.get("tokens") or 0) for s in steps)
    moves = metrics.get("moves", {})
    return {
        "steps_applied": metrics.get("steps_applied"),
        "switch_to_training_s": _median(sw.get("to_training_s", [])),
        "switch_to_rollout_s": _median(sw.get("to_rollout_s", [])),
        "switches_to_training": len(sw.get("to_training_s", [])),
        "switches_to_rollout": len(sw.get("to_rollout_s", [])),
        "switch_times": sw,
        "push_s": {str(s["version"]): s.get("push_s") for s in steps},
        "push_parts": {str(s["version"]): s.get("push_parts") for s in steps if s.get("push_parts")},
        "kv_migrations": moves.get("kv_migrations"),
        "moved_calls": moves.get("moved_calls"),
        "rollout_output_tokens": output_tokens,
        "rollout_busy_cell_s": round(roll_busy, 3),
        "rollout_tok_s_in_run": round(output_tokens / roll_busy, 1) if roll_busy > 0 else None,
        "train_tokens": train_tokens,
        "train_busy_cell_s": round(train_busy, 3),
        "train_tok_s_in_run": round(train_tokens / train_busy, 1) if train_busy > 0 else None,
        "idle": {
            k: metrics.get("roles", {}).get(k)
            for k in ("idle_rollout", "idle_training", "switching_share", "idle_total")
        },
        "scores": [s.get("mean_score") for s in steps],
        "losses": [s.get("loss") for s in steps],
        "end_to_end_s": metrics.get("end_to_end_s"),
        # the work done per second of the run: where executions end at their timeout, a policy's faster
        # rollout shows here (more calls made before the timeout), not in its end to end
        "rollout_tok_s_end_to_end": round(output_tokens / e2e, 1)
        if (e2e := metrics.get("end_to_end_s"))
        else None,
        **step_train_figures(metrics.get("steps", [])),
    }


def at_concurrency(tok_s_by_concurrency: dict[str, float], concurrency: float) -> float:
    """Standalone tokens/s at `concurrency`, linear between the measured concurrencies (clamped to the
    measured range): the in-run figure is compared with the engine at the load the run gave it."""
    pts = sorted((int(k), float(v)) for k, v in tok_s_by_concurrency.items())
    if not pts:
        raise ValueError("no standalone measurement")
    if concurrency <= pts[0][0]:
        return pts[0][1]
    for (c0, v0), (c1, v1) in itertools.pairwise(pts):
        if c0 <= concurrency <= c1:
            return round(v0 + (v1 - v0) * (concurrency - c0) / (c1 - c0), 1)
    return pts[-1][1]


def against_goals(res: dict[str, Any]) -> dict[str, bool | None]:
    """The two-cell run's goals, each true/false (None where a figure is missing): each switch direction's
    median within twice its floor plus 1 s, the median push within twice its floor plus 0.5 s, at least
    one KV migration, and `rollout_efficiency` (standalone engines' seconds for the run's own calls / the
    run's seconds with a call in flight) at least 0.8."""

    def le(x: Any, bound: Any) -> bool | None:
        return None if x is None or bound is None else bool(x <= bound)

    pushes = [v for v in res.get("push_s", {}).values() if v is not None]
    pf = res.get("push_floor_s")
    ft, fr = res.get("floor_to_training_s"), res.get("floor_to_rollout_s")
    eff = res.get("rollout_efficiency")
    return {
        "to_training_within_2x_floor_plus_1s": le(res.get("switch_to_training_s"), ft and 2 * ft + 1.0),
        "to_rollout_within_2x_floor_plus_1s": le(res.get("switch_to_rollout_s"), fr and 2 * fr + 1.0),
        "push_within_2x_floor_plus_0_5s": None
        if not pushes or pf is None
        else bool(statistics.median(pushes) <= 2 * pf + 0.5),
        "kv_migrations_at_least_1": None if res.get("kv_migrations") is None else res["kv_migrations"] >= 1,
        "rollout_efficiency_at_least_0_8": None if eff is None else bool(eff >= 0.8),
    }


def switch_parts(log_dir: str | Path) -> dict[str, Any]:
    """Where each switch spent its time, from the cells' `switch parts` log lines (logger `gyre.cell`): per
    direction, every switch's parts and the median of each part (to training: the engine's release, then
    joining training; to rollout: leaving training, the engine's resume, loading the newest weights)."""
    import json

    rows: dict[str, list[dict[str, Any]]] = {"TRAINING": [], "ROLLOUT": []}
    for f in sorted(Path(log_dir).glob("cell-*.log")):
        for line in f.read_text(errors="replace").splitlines():
            _, sep, rest = line.partition("switch parts ")
            if sep and rest.startswith("{"):
                try:
                    row = json.loads(rest)
                except ValueError:
                    continue
                rows.setdefault(str(row.get("to")), []).append(row)
    out: dict[str, Any] = {}
    for to, rs in rows.items():
        keys = sorted({k for r in rs for k in r if k.endswith("_s")})
        out[f"to_{to.lower()}"] = {
            "count": len(rs),
            "median": {k: _median([float(r[k]) for r in rs if k in r]) for k in keys},
            "each": rs,
        }
    return out
