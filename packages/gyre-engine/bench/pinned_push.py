"""The weight push through page-locked vs pageable host memory, side by side in one process on a GPU:
Qwen3-0.6B's parameter shapes in bf16 (about 1.2 GB), published from CUDA tensors into a gyre-xfer
publisher's slots (shared memory), pulled through an engine's gyre-xfer hub into its staging buffer, and
copied into CUDA parameters with the engine's `apply_named_tensors`. Each round runs both modes, in
alternating order; medians per phase and their ratios go to --out as JSON. Needs CUDA.

    python packages/gyre-engine/bench/pinned_push.py --out results-pinned-push.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from gyre_engine.protocol import UpdateFromXferRequest
from gyre_engine.server.weights import apply_named_tensors
from gyre_engine.server.xfer import XferHub, snapshot_tensors
from gyre_xfer.bench.run import qwen3_0_6b_shapes
from gyre_xfer.pinning import host_pinning
from gyre_xfer.publisher import Publisher, PublisherConfig
from gyre_xfer.transport import Config, open_transport


def qwen3_06b_shapes() -> dict[str, tuple[int, ...]]:
    """gyre-xfer's bench table of Qwen3-0.6B's tensors, named as module parameters (no dots)."""
    return {name.replace(".", "_"): shape for name, shape in qwen3_0_6b_shapes().items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results-pinned-push.json")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    dev = torch.device("cuda")
    shapes = qwen3_06b_shapes()
    model = torch.nn.Module()
    for name, shape in shapes.items():
        model.register_parameter(
            name, torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16, device=dev))
        )
    sources = [
        {n: torch.randn(s, dtype=torch.bfloat16, device=dev) for n, s in shapes.items()} for _ in range(2)
    ]
    nbytes = sum(t.numel() * 2 for t in sources[0].values())
    modes = {"pinned": host_pinning(dev), "pageable": None}
    assert modes["pinned"] is not None
    pubs = {
        m: Publisher(open_transport(Config(kind="shm")), PublisherConfig(pinning=p)) for m, p in modes.items()
    }
    hubs = {m: XferHub(pinning=p) for m, p in modes.items()}
    times: dict[str, dict[str, list[float]]] = {
        m: {"publish": [], "pull": [], "apply": [], "push": []} for m in modes
    }
    pinned_seen: dict[str, list[bool]] = {m: [] for m in modes}
    order = list(modes)
    for r in range(args.rounds + 1):  # round 0 allocates (and pins) the buffers: not counted
        src = sources[r % 2]
        for m in order if r % 2 == 0 else reversed(order):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            v = pubs[m].publish(src)
            t1 = time.perf_counter()
            snap = hubs[m].pull_snapshot(UpdateFromXferRequest(publisher=pubs[m].address, min_version=v))
            t2 = time.perf_counter()
            apply_named_tensors(model, snapshot_tensors(snap, model, "transformers"))
            t3 = time.perf_counter()
            if r == 0:
                continue
            pinned_seen[m].append(snap.pinned)
            for k, dt in (("publish", t1 - t0), ("pull", t2 - t1), ("apply", t3 - t2), ("push", t3 - t0)):
                times[m][k].append(dt)
            params = dict(model.named_parameters())
            assert all(torch.equal(params[n], t) for n, t in src.items()), f"{m}: weights differ"
    med = {m: {k: statistics.median(v) for k, v in ph.items()} for m, ph in times.items()}
    result = {
        "what": "weight push, Qwen3-0.6B shapes in bf16, shm transport, CUDA -> slot -> staging -> CUDA",
        "bytes": nbytes,
        "rounds": args.rounds,
        "device": torch.cuda.get_device_name(dev),
        "load_avg": os.getloadavg(),
        "staging_pinned": {m: all(v) for m, v in pinned_seen.items()},
        "median_s": med,
        "pageable_over_pinned": {k: med["pageable"][k] / med["pinned"][k] for k in med["pinned"]},
        "apply_gb_per_s": {m: nbytes / med[m]["apply"] / 1e9 for m in med},
        "publish_gb_per_s": {m: nbytes / med[m]["publish"] / 1e9 for m in med},
        "samples_s": times,
    }
    for h in hubs.values():
        h.close()
    for p in pubs.values():
        tr = p.transport
        p.close()
        tr.close()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k != "samples_s"}, indent=2))


if __name__ == "__main__":
    main()
