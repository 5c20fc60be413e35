"""The `gyre` command: `run` the whole system from a config, `eval` a checkpoint on the config's held-out
split, `compare` scheduling policies (with and without streaming) on one workload, with the gyre-sched
simulator's prediction beside each, `demo` (warm start, then RL that learns the built-in tasks),
`warmstart` (the warm start alone), `chaos` (a run under injected faults), `cell` (one cell process,
started by `gyre run`), and `version`. `run`, `eval`, `compare` and `chaos` take overrides after the
config, `SECTION.KEY=VALUE` (`train.lr=1e-5 batch.queries=16`), checked as the file is."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.metadata
import inspect
import itertools
import logging
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

from gyre.config.runconfig import POLICIES, Config

# Distributions that make up gyre; those not installed are shown as such.
_COMPONENTS = (
    "gyre",
    "gyre-base",
    "gyre-traj",
    "gyre-proxy",
    "gyre-engine",
    "gyre-sched",
    "gyre-xfer",
    "gyre-train",
)


def _versions() -> list[tuple[str, str | None]]:
    out: list[tuple[str, str | None]] = []
    for dist in _COMPONENTS:
        try:
            out.append((dist, importlib.metadata.version(dist)))
        except importlib.metadata.PackageNotFoundError:
            out.append((dist, None))
    return out


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gyre",
        description="Online RL for long-horizon LLM agents running inside black-box harnesses.",
        epilog="Component commands: gyre-traj, gyre-sched, gyre-engine, gyre-proxy, gyre-train, gyre-xfer.",
    )
    parser.add_argument("--version", action="store_true", help="print the version of each gyre component")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("version", help="print the version of each gyre component")
    r = sub.add_parser("run", help="run the whole system on this machine from a TOML/YAML config")
    r.add_argument("config", nargs="?", help="a .toml, .yaml or .json run config (see integration/examples/)")
    _overrides_arg(r)
    r.add_argument(
        "--resume",
        metavar="DIR",
        help="continue the unfinished run in DIR (killed, or ended by an error) from its checkpoint and "
        "record log, with the configuration it was started with (no CONFIG)",
    )
    r.add_argument("--policy", choices=POLICIES, help="override [run] policy")
    r.add_argument("--out", help="override [run] out_dir")
    from gyre.config.runconfig import RunSection

    r.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="override [run] ray_address: " + _field_docs(RunSection)["ray_address"],
    )
    r.add_argument(
        "--ray-resources",
        metavar="JSON",
        help="override [run] ray_resources (a JSON object: part -> {resource: amount}); with --resume, "
        "places the rest of the run anew (after a node was lost): "
        + _field_docs(RunSection)["ray_resources"],
    )
    r.add_argument("-v", "--verbose", action="store_true", help="log every component's decisions")
    c = sub.add_parser(
        "compare", help="the same workload under several policies (arms), with the simulator's predictions"
    )
    c.add_argument("config")
    _overrides_arg(c)
    c.add_argument("--out", help="override [run] out_dir (each arm gets a subdirectory)")
    c.add_argument(
        "--policies",
        default="elastic,elastic:whole,colocate,async",
        help="comma separated arms: POLICY (the config's streaming), POLICY:streaming or POLICY:whole; "
        f"policies: {', '.join(POLICIES)}",
    )
    c.add_argument("--repeats", type=int, default=1, help="runs per arm; the table shows medians")
    c.add_argument(
        "--reuse",
        action="store_true",
        help="do not run: read out_dir/<policy>/metrics.json of earlier runs (e.g. made on a GPU machine)",
    )
    c.add_argument("-v", "--verbose", action="store_true")
    x = sub.add_parser(
        "chaos",
        help="a run under injected faults (kills, stops, a full log disk); a JSON report of what it survived",
    )
    x.add_argument("config")
    _overrides_arg(x)
    x.add_argument("--faults", type=int, default=20, help="faults to inject (default: 20)")
    x.add_argument("--seed", type=int, default=0, help="which faults, when (default: 0)")
    x.add_argument("--out", required=True, help="the run directory (new); the report is OUT/chaos.json")
    x.add_argument(
        "--kinds", default="", help="comma separated fault kinds (default: all; see gyre.scenarios.chaos)"
    )
    x.add_argument(
        "--failure-timeout-s", type=float, default=8.0, help="gyre-sched's failure timeout during the run"
    )
    e = sub.add_parser(
        "eval",
        help="evaluation only: a HuggingFace checkpoint directory on the config's held-out split, scored as "
        "a run's evaluations are (printed, and appended to OUT/evals.jsonl)",
    )
    e.add_argument("config", help="the run config whose [eval], [tasks] and [agent] say what to score")
    _overrides_arg(e)
    e.add_argument("--checkpoint", required=True, metavar="DIR", help="a HuggingFace model directory")
    e.add_argument("--out", metavar="DIR", help="where evals.jsonl and the logs go (default: OUT_DIR/eval)")
    e.add_argument("-v", "--verbose", action="store_true")
    from gyre.rollout.warmstart import WarmStartConfig
    from gyre.scenarios.demo import DemoConfig

    d = sub.add_parser(
        "demo", help="warm start, then RL that measurably learns the built-in tasks (minutes on 2 CPU cores)"
    )
    _dataclass_args(d, DemoConfig)
    w = sub.add_parser("warmstart", help="the supervised warm start alone (cached; prints its directory)")
    _dataclass_args(w, WarmStartConfig)
    w.add_argument("--check", type=int, default=0, help="then score it greedily on this many held-out tasks")
    cell = sub.add_parser("cell", help="one cell process (started by `gyre run`)")
    cell.add_argument("--args", required=True)
    node = sub.add_parser(
        "node",
        help="a node agent: starts the processes a `gyre run` on another node asks of this one (SLURM)",
    )
    node.add_argument("nodes_dir", help="[run] nodes_dir of the run (a directory every node sees)")
    node.add_argument("--node-id", type=int, required=True, help="this node's number, 1.. (SLURM_NODEID)")
    node.add_argument("--host", required=True, help="this node's address, which its processes bind")
    node.add_argument("--token-file", default="", help="the run token's file (default: $GYRE_TOKEN)")
    return parser


def _overrides_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="SECTION.KEY=VALUE",
        help="override a key of the config, checked as the file is (e.g. train.lr=1e-5 batch.queries=16)",
    )


_OVERRIDE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*=")


def _field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (the configuration's reference), by field name, as
    argparse help text (a `%` doubled: argparse formats help with `%`)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for a, b in itertools.pairwise(body):
        named = isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)
        if (
            named
            and isinstance(b, ast.Expr)
            and isinstance(b.value, ast.Constant)
            and isinstance(b.value.value, str)
        ):
            docs[a.target.id] = " ".join(b.value.value.split()).replace("%", "%%")
    return docs


def _dataclass_args(p: argparse.ArgumentParser, cls: type) -> None:
    """One option per field of the config dataclass `cls`, its default and docstring as the help."""
    docs = _field_docs(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        doc = docs.get(f.name, "")
        if f.type in (bool, "bool"):
            p.add_argument(flag, action="store_true", help=doc)
        else:
            kind = {"int": int, "float": float, "str": str}.get(str(f.type), str)
            default = str(f.default).replace("%", "%%")
            p.add_argument(flag, type=kind, default=f.default, help=f"{doc} (default: {default})")


def _fields(ns: argparse.Namespace, cls: type) -> Any:
    return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})


def _load(path: str, overrides: list[str] | None = None) -> Config:
    """The run config in `path` with `overrides`, its harness and its own tasks checked too
    (`ConfigError`s name the file, or the override, and the key)."""
    from gyre.config.runconfig import ConfigError, load_config
    from gyre.rollout.harnesses import check_harness, check_tasks

    cfg = load_config(path, overrides or [])
    try:
        check_harness(cfg.agent)
        check_tasks(cfg)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    return cfg


def _demo(args: argparse.Namespace) -> int:
    from gyre.procs.group import ChildDied
    from gyre.scenarios.demo import DemoConfig, demo
    from gyre.system.attempt import RunError
    from gyre.system.rundir import RunDirError

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        demo(_fields(args, DemoConfig), say=lambda m: print(m, flush=True))
    except (RunError, ChildDied, RunDirError) as exc:
        print(f"gyre demo: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _chaos(args: argparse.Namespace) -> int:
    import json

    from gyre.config.runconfig import ConfigError
    from gyre.scenarios.chaos import KINDS, chaos

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip()) or KINDS
    try:
        cfg = _load(args.config, args.overrides)
        report = chaos(
            cfg, args.faults, args.seed, Path(args.out), kinds, args.failure_timeout_s,
            say=lambda m: print(m, flush=True),
        )  # fmt: skip
    except (ConfigError, ValueError) as exc:
        print(f"gyre chaos: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({k: report[k] for k in ("finished", "injections", "recovered", "records_lost",
                                              "records_trained_twice", "by_kind")}, indent=1))  # fmt: skip
    ok = report["finished"] and report["records_lost"] == 0 and report["records_trained_twice"] == 0
    return 0 if ok else 1


def _warmstart(args: argparse.Namespace) -> int:
    import json

    from gyre.rollout.warmstart import WarmStartConfig, check, warm_start

    path, meta = warm_start(_fields(args, WarmStartConfig), say=lambda m: print(m, file=sys.stderr))
    print(path)
    if args.check:
        print(json.dumps(check(path, args.check, meta["config"]["max_tokens"])))
    return 0


def _run_or_compare(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`gyre run` and `gyre compare`: the config loaded and checked (exit 2 on a refused one), then run
    (exit 1 on a failed run, 130 when interrupted)."""
    from gyre.config.runconfig import ConfigError
    from gyre.rollout.harnesses import check_harness
    from gyre.system.rundir import RunDirError

    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.command == "run" and (args.resume is None) == (args.config is None):
        parser.error("gyre run: give a CONFIG or --resume DIR (not both)")
    if args.command == "run" and args.resume and (args.out or args.policy or args.overrides):
        parser.error("gyre run --resume: the run goes on as it was started (no --out, --policy or overrides)")
    try:
        if args.command == "run" and args.resume:
            from gyre.system.run import resume_config

            cfg = resume_config(Path(args.resume))
            check_harness(cfg.agent)
        else:
            cfg = _load(args.config, args.overrides)
        if args.out:
            cfg = cfg.with_policy(cfg.run.policy, args.out)
        if args.command == "run" and args.policy:
            cfg = cfg.with_policy(args.policy, cfg.run.out_dir)
        if args.command == "run" and args.ray is not None:
            cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, ray_address=args.ray))
        if args.command == "run" and args.ray_resources is not None:
            cfg = _with_ray_resources(cfg, args.ray_resources)
    except (ConfigError, RunDirError) as exc:
        print(f"gyre {args.command}: {exc}", file=sys.stderr)
        return 2
    from gyre.procs.group import ChildDied
    from gyre.system.attempt import RunError
    from gyre.system.launch import PlacementError

    try:
        if args.command == "run":
            from gyre.system.run import run

            run(cfg, resume=bool(args.resume))
        else:
            from gyre.scenarios.compare import compare

            arms = [p.strip() for p in args.policies.split(",") if p.strip()]
            compare(cfg, arms, reuse=args.reuse, repeats=args.repeats)
    except (RunError, ChildDied, ConfigError, PlacementError, RunDirError) as exc:
        print(f"gyre {args.command}: error: {exc}", file=sys.stderr)
        if args.command == "run" and args.resume:
            from gyre.system.rundir import steps_done

            if steps_done(Path(args.resume)) == 0:
                print(
                    f"gyre run: {args.resume} never reached its first step, so --resume repeats its "
                    f"configuration: start it again with a corrected one (gyre run CONFIG --out "
                    f"{args.resume})",
                    file=sys.stderr,
                )
        return 1
    except KeyboardInterrupt:  # every child was stopped on the way out
        print(f"gyre {args.command}: interrupted", file=sys.stderr)
        return 130
    return 0


def _eval(args: argparse.Namespace) -> int:
    """`gyre eval`: the config loaded and checked (exit 2 on a refused one, or a checkpoint that is not a
    model directory), then one evaluation (exit 1 when a part fails)."""
    import json

    from gyre.config.runconfig import ConfigError
    from gyre.procs.group import ChildDied
    from gyre.system.evalonly import EvalError, evaluate_checkpoint

    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        cfg = _load(args.config, args.overrides)
        out = Path(args.out) if args.out else Path(cfg.run.out_dir) / "eval"
        result = evaluate_checkpoint(cfg, Path(args.checkpoint), out, say=lambda m: print(m, flush=True))
    except ConfigError as exc:
        print(f"gyre eval: {exc}", file=sys.stderr)
        return 2
    except (EvalError, ChildDied) as exc:
        print(f"gyre eval: error: {exc}", file=sys.stderr)
        return 1
    fams = ", ".join(f"{k} {v}" for k, v in result["by_family"].items())
    print(
        f"gyre eval: score {result['score']} on {result['tasks']} tasks ({fams}); "
        f"{result['eval_failed']} evaluation failures, {result['timed_out']} timed out -> {out / 'evals.jsonl'}"
    )
    print(json.dumps({k: v for k, v in result.items() if k not in ("answers", "failures")}))
    return 0


def _with_ray_resources(cfg: Config, text: str) -> Config:
    """`cfg` with `[run] ray_resources` from the JSON `text` (checked as the config file's would be)."""
    import json

    from gyre.config.runconfig import ConfigError, config_from_dict

    try:
        table = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--ray-resources is not JSON: {exc}") from exc
    raw = cfg.to_dict()
    raw["run"]["ray_resources"] = table
    return config_from_dict(raw)


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "cell":
        from gyre.cell.cell import main as cell_main

        return cell_main(["--args", args.args, *rest])
    if args.command == "node":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        from gyre.system.nodeagent import NodeAgent

        if args.node_id < 1:
            parser.error("--node-id must be >= 1 (node 0 runs `gyre run`)")
        agent = NodeAgent(Path(args.nodes_dir), args.node_id, args.host, args.token_file)
        return agent.run()
    if hasattr(args, "overrides"):  # overrides after an option land in `rest`
        args.overrides = [*args.overrides, *(r for r in rest if _OVERRIDE.match(r))]
        rest = [r for r in rest if not _OVERRIDE.match(r)]
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "demo":
        return _demo(args)
    if args.command == "warmstart":
        return _warmstart(args)
    if args.version or args.command == "version":
        for dist, version in _versions():
            print(f"{dist:<12} {version if version is not None else '(not installed)'}")
        return 0
    if args.command == "chaos":
        return _chaos(args)
    if args.command == "eval":
        return _eval(args)
    if args.command in ("run", "compare"):
        return _run_or_compare(args, parser)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
