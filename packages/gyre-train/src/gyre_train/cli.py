"""`gyre-train`: run a core, a satellite, or the benchmark.

gyre-train core --synthetic 3 --admit-all --checkpoint ckpt/    # prints its address, then a JSON line per step
gyre-train satellite --core tcp://127.0.0.1:PORT --name sat-0
gyre-train bench [--quick] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from gyre_traj.loss import LossConfig


def _core(args: argparse.Namespace) -> int:
    from gyre_train.core import Core, CoreConfig, OptimConfig
    from gyre_train.data import read_packed_dir, synthetic_minibatch
    from gyre_train.model import ModelConfig, build_model

    mc = ModelConfig(seed=args.seed)
    cfg = CoreConfig(
        bind=args.bind,
        transport=args.transport,
        token_budget=args.budget,
        attention=args.attention,
        wire_dtype=args.wire_dtype,
        admit_on_hello=args.admit_all,
        loss=LossConfig(mode=args.loss),
        optim=OptimConfig(lr=args.lr),
    )
    core = Core(build_model(mc, cfg.attention, args.device), mc, cfg)
    try:
        ckpt = Path(args.checkpoint) if args.checkpoint else None
        if ckpt is not None and (ckpt / "state.json").exists():
            core.load(ckpt)
        print(
            json.dumps(
                {"address": core.address, "publisher": core.publisher.address, "version": core.version}
            ),
            flush=True,
        )
        deadline = time.monotonic() + args.wait_satellites_s
        while len(core.replicas()) < args.wait_satellites and time.monotonic() < deadline:
            time.sleep(0.05)
        if args.feed:  # steps from the trajectory service (CoreClient: submit, or open_step/add/close_step)
            trained = 0
            while args.steps == 0 or trained < args.steps:
                step = core.next_step(args.feed_idle_s)
                if step is None:
                    break
                rep = core.train_step(step)
                trained += 1
                if ckpt is not None:
                    core.save(ckpt)
                print(json.dumps(asdict(rep)), flush=True)
            return 0
        if args.data:
            sources = [Path(d) for d in args.data]
        total = len(args.data) if args.data else args.synthetic
        while core.queue_position < total:
            k = core.queue_position
            mbs = (
                read_packed_dir(sources[k])
                if args.data
                else synthetic_minibatch(4, seed=k, token_budget=args.budget)
            )
            rep = core.train_step(mbs)
            if ckpt is not None:
                core.save(ckpt)
            print(json.dumps(asdict(rep)), flush=True)
    finally:
        core.close()
    return 0


def _satellite(args: argparse.Namespace) -> int:
    from gyre_train.satellite import Satellite, SatelliteConfig

    sat = Satellite(
        SatelliteConfig(
            core=args.core,
            name=args.name,
            device=args.device,
            reply_timeout_s=args.reply_timeout_s,
            idle_exit_s=args.idle_exit_s,
            crash_after_claims=args.crash_after_claims,
            warmup=args.warmup,
        )
    )
    print(json.dumps({"ready": args.name, "warmup_s": sat.warmup_s}), flush=True)
    try:
        n = sat.run()
    finally:
        sat.close()
    print(json.dumps({"name": args.name, "microbatches": n, "version": sat.version}), flush=True)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from gyre_train.bench.run import main as bench_main

    return bench_main(args)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="gyre-train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("core", help="run the core replica over synthetic or packed mini-batches")
    c.add_argument("--bind", default="tcp://127.0.0.1:0")
    c.add_argument("--transport", default="shm", choices=["shm", "mooncake"])
    c.add_argument(
        "--wire-dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="dtype gradients are handed over in (each micro-batch's gradient is rounded to it once)",
    )
    c.add_argument("--synthetic", type=int, default=2, help="train this many synthetic mini-batches")
    c.add_argument("--data", nargs="*", help="`gyre-traj pack --out` directories, one mini-batch each")
    c.add_argument("--feed", action="store_true", help="train what the trajectory service submits")
    c.add_argument("--steps", type=int, default=0, help="--feed: stop after this many steps (0 = no limit)")
    c.add_argument(
        "--feed-idle-s", type=float, default=600.0, help="--feed: stop after this long without one"
    )
    c.add_argument("--budget", type=int, default=1024)
    c.add_argument("--attention", default="dense", choices=["dense", "flex"])
    c.add_argument("--device", default="cpu")
    c.add_argument("--loss", default="ppo", choices=["ppo", "tis"])
    c.add_argument("--lr", type=float, default=1e-4)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--admit-all", action="store_true", help="admit every satellite that says hello")
    c.add_argument("--wait-satellites", type=int, default=0, help="wait for this many satellites first")
    c.add_argument("--wait-satellites-s", type=float, default=60.0)
    c.add_argument("--checkpoint", help="directory: resume from it if present, save after every step")
    c.set_defaults(fn=_core)
    s = sub.add_parser("satellite", help="run a satellite replica of a core")
    s.add_argument("--core", required=True)
    s.add_argument("--name", required=True)
    s.add_argument("--device", default="cpu")
    s.add_argument("--reply-timeout-s", type=float, default=30.0)
    s.add_argument("--idle-exit-s", type=float, default=0.0)
    s.add_argument("--crash-after-claims", type=int, default=0, help="fault injection for tests")
    s.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="warm-up micro-batches at start (default: 2 on a GPU, 0 on the CPU)",
    )
    s.set_defaults(fn=_satellite)
    b = sub.add_parser("bench", help="tree-packed vs path-expanded training and satellite join time")
    b.add_argument("--quick", action="store_true")
    b.add_argument("--device", default="cpu")
    b.add_argument("--out", help="also write the result JSON here")
    b.add_argument(
        "--cases",
        default="fan,synthetic-agent,large-tree-chunked,huge-tree,join,handoff",
        help="comma-separated subset of: fan, synthetic-agent, large-tree-chunked, huge-tree, join, handoff",
    )
    b.add_argument(
        "--huge-trunk",
        type=int,
        default=0,
        help="huge-tree trunk tokens (default 262144 on CUDA, 4096 on CPU, 1024 with --quick)",
    )
    b.add_argument(
        "--huge-paths",
        type=int,
        default=0,
        help="huge-tree: time this many of its identical paths and scale to all (default 0: all)",
    )
    b.add_argument(
        "--huge-repeats", type=int, default=1, help="huge-tree: rounds of tree and paths (medians)"
    )
    b.set_defaults(fn=_bench)
    args = ap.parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
