"""The `gyre-sched` command: serve, cell, simulate, bench. Thin: parse, build configs, call, print."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import replace
from typing import Any

from gyre_base.token import TokenError

from gyre_sched import __version__
from gyre_sched.policy import POLICY_NAMES, WaterLevelConfig
from gyre_sched.workload import ConfigError

POLICY_HELP = "; ".join(f"{k}: {v}" for k, v in POLICY_NAMES.items())


def _token(a: argparse.Namespace) -> str:
    """The run token of `--token-file`, or "" (then $GYRE_TOKEN, or none)."""
    from gyre_base.token import read_token_file

    return read_token_file(a.token_file) if a.token_file else ""


def _serve(a: argparse.Namespace) -> int:
    from gyre_sched.service import Scheduler, ServiceConfig, serve_main
    from gyre_sched.sim import make_policy
    from gyre_sched.workload import AsyncConfig, Workload

    w = Workload(
        async_=AsyncConfig(train_cells=a.async_train_cells),
        elastic=WaterLevelConfig(
            hold_s=a.hold_s, ready_fraction=a.ready_fraction, train_complete_steps=a.train_complete_steps
        ),
    )
    w = replace(w, run=replace(w.run, cells=max(2, a.async_train_cells + 1), timeout_h=a.timeout_h))
    policy = make_policy(a.policy, w)
    n_sw = a.max_concurrent_switches or (1000 if policy.moves_together else 1)
    cfg = ServiceConfig(
        bind=a.bind,
        heartbeat_s=a.heartbeat_s,
        failure_timeout_s=a.failure_timeout_s,
        switch_timeout_s=a.switch_timeout_s,
        drain_timeout_s=a.drain_timeout_s,
        max_concurrent_switches=n_sw,
        token=_token(a),
    )
    sched = Scheduler(policy, cfg)
    print(f"gyre-sched listening on {sched.endpoint} (policy {policy.name})", flush=True)
    return serve_main(sched)


def _cell(a: argparse.Namespace) -> int:
    from gyre_sched.cellproc import CellConfig, SchedulerGone, run_cell

    cfg = CellConfig(
        a.connect,
        a.id,
        a.core,
        a.capacity,
        a.endpoint,
        a.switch_s,
        hello_timeout_s=a.hello_timeout_s,
        run_s=a.run_s,
        peer_timeout_s=a.peer_timeout_s,
        token=_token(a),
    )
    try:
        return run_cell(cfg)
    except SchedulerGone as exc:
        print(f"gyre-sched cell {a.id}: {exc}", file=sys.stderr)
        return 2


def _fmt(r: dict[str, Any]) -> str:
    return (
        f"{r['policy']:<17} {'yes' if r['streaming'] else 'no ':<4} {r['end_to_end_h']:8.2f} "
        f"{r['idle_total']:6.1%} {r['idle_rollout']:7.1%} {r['idle_training']:7.1%} "
        f"{r['staleness_mean']:6.2f} {r['staleness_max']:4.0f} {r['switches']:6d} {r['timeouts']:6d} {r['extra_timeouts']:6d}"
    )


def _simulate(a: argparse.Namespace) -> int:
    from gyre_sched.sim import compare, run_one
    from gyre_sched.workload import load_workload

    w = load_workload(a.config)
    if a.seed is not None:
        w = replace(w, run=replace(w.run, seed=a.seed))
    if a.steps is not None:
        w = replace(w, run=replace(w.run, steps=a.steps))
    streaming = (
        [w.driver.streaming]
        if a.streaming == "config"
        else {"on": [True], "off": [False], "both": [True, False]}[a.streaming]
    )
    if a.policy == "compare":
        results, summary = compare(w, streaming=streaming, predictive=True)
    else:
        results = [run_one(w, a.policy, streaming=s) for s in streaming]
        summary = {}
    rows = [r.summary() for r in results]
    print(
        f"workload {w.name}: {w.run.steps} steps, {w.run.cells} cells, {w.batch.queries}x{w.batch.group_size} executions/step"
    )
    print(f"{'policy':<17} str.  hours    idle  rollout training stale  max  switch timeout extraTO")
    for r in rows:
        print(_fmt(r))
    for k, v in summary.items():
        print(f"{k}: {v:.3f}")
    if a.log:
        with open(a.log, "w") as f:
            for res in results:
                for d in res.decisions:
                    import msgspec

                    f.write(
                        json.dumps(
                            {"policy": res.policy, "streaming": res.streaming, **msgspec.to_builtins(d)}
                        )
                        + "\n"
                    )
    if a.plot:
        from gyre_sched.plot import PlotUnavailable, timeline_png

        try:
            timeline_png(results, a.plot, w.run.cells)
        except PlotUnavailable as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"timeline written to {a.plot}")
    print(json.dumps({"results": rows, **summary}))
    return 0


def _bench(a: argparse.Namespace) -> int:
    from gyre_sched.bench import run_bench

    out = run_bench(quick=a.quick)
    print(json.dumps(out))
    return 0


def _token_flag(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--token-file",
        default="",
        help=f"file whose first line is the run token ({what}); without it, $GYRE_TOKEN, or none",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gyre-sched", description="Elastic rollout/training scheduler and its simulator."
    )
    p.add_argument("--version", action="version", version=f"gyre-sched {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="run the scheduler service on a ZeroMQ socket")
    s.add_argument("--bind", default="tcp://127.0.0.1:5557", help="ROUTER address (port 0: pick a free one)")
    _token_flag(s, "needed to bind beyond loopback; peers must hold the same token")
    s.add_argument("--policy", default="elastic", choices=list(POLICY_NAMES), help=POLICY_HELP)
    s.add_argument("--async-train-cells", type=int, default=1)
    s.add_argument("--ready-fraction", type=float, default=0.25)
    s.add_argument("--hold-s", type=float, default=120.0)
    s.add_argument(
        "--train-complete-steps",
        action=argparse.BooleanOptionalAction,
        default=WaterLevelConfig().train_complete_steps,
        help="elastic: the core stays for a complete step when demand returns, and goes to train one "
        "that the next batch waits for at once",
    )
    s.add_argument(
        "--timeout-h", type=float, default=6.0, help="executions' hard timeout (predictive policy)"
    )
    s.add_argument("--heartbeat-s", type=float, default=1.0)
    s.add_argument("--failure-timeout-s", type=float, default=5.0)
    s.add_argument("--switch-timeout-s", type=float, default=120.0)
    s.add_argument("--drain-timeout-s", type=float, default=30.0)
    s.add_argument(
        "--max-concurrent-switches",
        type=int,
        default=0,
        help="0: 1 for elastic, all for whole-pool/split policies",
    )
    s.set_defaults(fn=_serve)

    c = sub.add_parser("cell", help="run a lightweight protocol-only cell (no engine, no trainer)")
    c.add_argument("--connect", required=True)
    c.add_argument("--id", type=int, required=True)
    c.add_argument("--core", action="store_true")
    c.add_argument("--capacity", type=int, default=64)
    c.add_argument("--endpoint", default="")
    c.add_argument("--switch-s", type=float, default=0.05)
    c.add_argument("--hello-timeout-s", type=float, default=10.0, help="give up without a Welcome after this")
    c.add_argument("--run-s", type=float, default=0.0)
    c.add_argument("--peer-timeout-s", type=float, default=30.0)
    _token_flag(c, "the scheduler's")
    c.set_defaults(fn=_cell)

    m = sub.add_parser("simulate", help="simulate a whole RL run")
    m.add_argument("config", help="workload .toml/.json, or a preset name (2p4t, tb122b)")
    m.add_argument(
        "--policy",
        default="compare",
        choices=[*POLICY_NAMES, "compare"],
        help=POLICY_HELP + "; compare: all of them",
    )
    m.add_argument("--streaming", default="config", choices=["config", "on", "off", "both"])
    m.add_argument("--seed", type=int)
    m.add_argument("--steps", type=int)
    m.add_argument("--plot", help="write the timeline PNG here (needs gyre-sched[plot])")
    m.add_argument("--log", help="write every decision, with its quantities, as JSON lines here")
    m.set_defaults(fn=_simulate)

    b = sub.add_parser("bench", help="decision latency, simulator speed, the preset's three policies")
    b.add_argument("--quick", action="store_true")
    b.set_defaults(fn=_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr
    )
    a = build_parser().parse_args(argv)
    try:
        rc: int = a.fn(a)
    except (ConfigError, TokenError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return rc


if __name__ == "__main__":
    sys.exit(main())
