"""The `gyre-traj` command: `inspect` a record file, `pack` it into training micro-batches, `compact` it
into call batches, `bench`.

Works without torch. Input is gyre's JSONL or framed msgpack records, or another system's traces (per-turn
rows, verl dumps, slime samples, message logs); the format is told from the file unless `--format` names it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from gyre_traj import __version__
from gyre_traj.io import FORMATS, Record, batch_calls, iter_msgpack, read_records, sniff_format, write_records
from gyre_traj.pack import PackConfig, PackError, PackItem, pack
from gyre_traj.records import Call, CallBatch, RecordError, Role, Score, defer_input_sign_check
from gyre_traj.select import SelectionConfig, select
from gyre_traj.summary import EXTENDS, ExecutionSummary, summarize
from gyre_traj.tree import Forest
from gyre_traj.weights import AdvantageConfig, group_advantages


def _selection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--j-max", type=int, default=5, help="trajectories selected per execution (0: all)")
    p.add_argument(
        "--priority",
        default=",".join(r.value for r in Role),
        help="roles in selection priority order, comma separated",
    )
    _format_args(p)


def _format_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--format", choices=FORMATS, default=None, help="input format (told from the file by default)"
    )
    p.add_argument(
        "--reward-key",
        default=None,
        help="where rewards are dicts (slime samples, message logs), the entry to train on",
    )


def _selection_cfg(args: argparse.Namespace) -> SelectionConfig:
    try:
        prio = tuple(Role(r.strip()) for r in args.priority.split(",") if r.strip())
    except ValueError as exc:
        raise SystemExit(f"gyre-traj: --priority: {exc}") from None
    return SelectionConfig(j_max=None if args.j_max == 0 else args.j_max, priority=prio)


def _load(path: str, fmt: str | None, reward_key: str | None = None) -> Forest:
    return _load_with_extends(path, fmt, reward_key)[0]


def _load_with_extends(
    path: str, fmt: str | None, reward_key: str | None = None
) -> tuple[Forest, dict[str, dict[str, str]]]:
    """The forest, and per execution the calls whose metadata names a call they extend."""
    forest = Forest()
    extends: dict[str, dict[str, str]] = {}

    def add(recs: Iterator[Record]) -> None:
        for rec in recs:
            forest.add(rec)
            if isinstance(rec, Call) and EXTENDS in rec.metadata:
                extends.setdefault(rec.execution_id, {})[rec.call_id] = rec.metadata[EXTENDS]

    if (fmt or sniff_format(path)) == "msgpack":
        with defer_input_sign_check():  # as Forest.add_msgpack: the tree checks what it stores
            add(iter_msgpack(Path(path).read_bytes(), path))
    else:
        add(read_records(path, fmt, reward_key=reward_key))  # type: ignore[arg-type]
    return forest, extends


def _fmt_int(n: int) -> str:
    return f"{n:,}"


def _print_summary(s: ExecutionSummary) -> None:
    score = (
        "unscored"
        if s.score_status == "unscored"
        else ("eval failed" if s.score is None else f"{s.score:.3f}")
    )
    print(f"execution {s.execution_id}   score: {score}")
    rows = [
        ("calls", f"{s.calls} ({s.delta_calls} delta-encoded)"),
        ("unique tokens", _fmt_int(s.unique_tokens)),
        ("call-expanded tokens", f"{_fmt_int(s.call_tokens)}   dedup ratio {s.dedup_ratio:.2f}x"),
        ("path-expanded tokens", _fmt_int(s.path_tokens)),
        ("policy tokens", _fmt_int(s.policy_tokens)),
        ("branches (leaves) by role", ", ".join(f"{k} {v}" for k, v in sorted(s.leaves_by_role.items()))),
        ("drift (context contradicts policy)", str(s.drifts)),
        (
            "non-extensions (reuse missed)",
            f"{s.non_extensions} of {s.appended_calls} calls that only appended",
        ),
        (
            "selected: unique / path tokens",
            f"{_fmt_int(s.selected_unique_tokens)} / {_fmt_int(s.selected_path_tokens)}",
        ),
        (
            "loss tokens (each once)",
            f"{_fmt_int(s.loss_tokens)}   ({_fmt_int(s.dropped_policy_tokens)} policy tokens not selected)",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    print(f"  selected trajectories ({len(s.selected)}):")
    print(f"    {'#':>2}  {'leaf call':<14} {'role':<17} {'tokens':>10} {'policy':>9}")
    for i, t in enumerate(s.selected, 1):
        print(f"    {i:>2}  {t.call_id:<14} {t.role:<17} {t.tokens:>10,} {t.policy_tokens:>9,}")
    print()


def cmd_inspect(args: argparse.Namespace) -> int:
    forest, extends = _load_with_extends(args.file, args.format, args.reward_key)
    cfg = _selection_cfg(args)
    summaries = [summarize(tree, cfg, extends=extends.get(tree.execution_id)) for tree in forest]
    for tree in forest:
        for d in tree.stats.drifts[: args.show_drift]:
            print(
                f"drift: execution {tree.execution_id} call {d.call_id} input position {d.position}: "
                f"context token {d.got}, policy had produced {list(d.expected)}",
                file=sys.stderr,
            )
    if args.json:
        print(json.dumps([s.as_dict() for s in summaries], indent=1))
        return 0
    for s in summaries:
        _print_summary(s)
    unique = sum(s.unique_tokens for s in summaries)
    expanded = sum(s.call_tokens for s in summaries)
    print(
        f"{len(summaries)} executions, {sum(s.calls for s in summaries)} calls, "
        f"{_fmt_int(unique)} unique tokens of {_fmt_int(expanded)} call-expanded "
        f"(dedup {expanded / max(1, unique):.2f}x), {sum(s.drifts for s in summaries)} drift events, "
        f"{sum(s.non_extensions for s in summaries)} non-extensions"
    )
    return 0


def cmd_pack(args: argparse.Namespace) -> int:
    forest = _load(args.file, args.format, args.reward_key)
    cfg = _selection_cfg(args)
    scores = [t.score for t in forest if t.score is not None]
    adv, adv_stats = group_advantages(scores, AdvantageConfig(std_normalize=args.std_normalize))
    items: list[PackItem] = []
    unscored = 0
    for tree in forest:
        if tree.execution_id in adv:
            items.append(PackItem(tree, select(tree, cfg), adv[tree.execution_id]))
        elif tree.score is None:
            unscored += 1
            if args.unscored == "zero":
                items.append(PackItem(tree, select(tree, cfg), 0.0))
    if not items:
        raise SystemExit(
            f"gyre-traj pack: nothing to pack: {len(forest)} executions, {unscored} unscored "
            f"(pass --unscored zero to pack them with advantage 0), "
            f"{adv_stats.eval_failed} evaluation failures, "
            f"{adv_stats.groups_too_small} groups too small"
        )
    batches = pack(items, PackConfig(token_budget=args.budget, mode=args.mode))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for k, b in enumerate(batches):
        name = f"microbatch-{k:05d}.npz"
        np.savez(
            out / name,
            input_ids=b.input_ids,
            position_ids=b.position_ids,
            parent=b.parent,
            last_desc=b.last_desc,
            segment=b.segment,
            target_pos=b.target_pos,
            target_ids=b.target_ids,
            old_logprobs=b.old_logprobs,
            advantages=b.advantages,
            weights=b.weights,
            versions=b.versions,
            target_nodes=b.target_nodes,
        )
        files.append(
            {
                "file": name,
                "tokens": b.num_tokens,
                "loss_tokens": b.num_loss_tokens,
                "executions": list(b.executions),
            }
        )
    manifest = {
        "gyre_traj_version": __version__,
        "mode": args.mode,
        "token_budget": args.budget,
        "executions": len(items),
        "unscored_skipped": unscored if args.unscored == "skip" else 0,
        "eval_failed": adv_stats.eval_failed,
        "groups_too_small": adv_stats.groups_too_small,
        "tokens": sum(f["tokens"] for f in files),  # type: ignore[misc]
        "loss_tokens": sum(f["loss_tokens"] for f in files),  # type: ignore[misc]
        "micro_batches": files,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(
        f"packed {len(items)} executions into {len(batches)} micro-batches "
        f"({manifest['tokens']:,} tokens, {manifest['loss_tokens']:,} loss tokens, mode {args.mode}) "
        f"-> {out}/"
    )
    if adv_stats.eval_failed or unscored:
        print(
            f"left out: {adv_stats.eval_failed} evaluation failures, "
            f"{unscored if args.unscored == 'skip' else 0} unscored executions"
        )
    return 0


def cmd_compact(args: argparse.Namespace) -> int:
    """Rewrite a record file as framed msgpack with calls in `CallBatch`es (the fast ingest format)."""
    src, dst = Path(args.file), Path(args.out)
    if src.resolve() == dst.resolve():
        raise SystemExit("gyre-traj compact: --out must differ from the input file")
    if args.batch < 1:
        raise SystemExit(f"gyre-traj compact: --batch must be >= 1, got {args.batch}")
    counts = {"calls": 0, "scores": 0, "batches": 0}

    def counted(recs: Iterator[Record]) -> Iterator[Record]:
        for rec in recs:
            if isinstance(rec, CallBatch):
                counts["batches"] += 1
                counts["calls"] += len(rec)
            elif isinstance(rec, Score):
                counts["scores"] += 1
            yield rec

    # Records are validated on the way in; nothing is written when one is bad.
    tmp = dst.with_name(dst.name + ".partial")
    try:
        recs = read_records(src, args.format, reward_key=args.reward_key)
        write_records(tmp, counted(batch_calls(recs, args.batch)), "msgpack")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(dst)
    print(
        f"{counts['calls']} calls in {counts['batches']} call batches and {counts['scores']} scores "
        f"-> {dst} ({src.stat().st_size:,} -> {dst.stat().st_size:,} bytes)"
    )
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from gyre_traj.bench import run_bench

    return run_bench(quick=args.quick, out=args.out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gyre-traj",
        description="Trajectory trees and training data from recorded agent traces (TITO records).",
    )
    p.add_argument("--version", action="version", version=f"gyre-traj {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    pi = sub.add_parser("inspect", help="summarize a record file: tokens, dedup, branches, drift, selection")
    pi.add_argument("file")
    pi.add_argument("--json", action="store_true", help="print summaries as JSON")
    pi.add_argument("--show-drift", type=int, default=5, help="drift events to print per execution (stderr)")
    _selection_args(pi)
    pi.set_defaults(func=cmd_inspect)
    pp = sub.add_parser("pack", help="select, weight and pack executions into micro-batches (.npz)")
    pp.add_argument("file")
    pp.add_argument("--out", required=True, help="output directory")
    pp.add_argument(
        "--budget",
        type=int,
        default=PackConfig.token_budget,
        help="tokens per micro-batch (default: %(default)s)",
    )
    pp.add_argument("--mode", choices=["tree", "paths"], default="tree")
    pp.add_argument("--std-normalize", action="store_true", help="divide advantages by the group std")
    pp.add_argument(
        "--unscored",
        choices=["skip", "zero"],
        default="skip",
        help="executions without a score: leave out (default) or pack with advantage 0",
    )
    _selection_args(pp)
    pp.set_defaults(func=cmd_pack)
    pc = sub.add_parser(
        "compact", help="rewrite records as msgpack call batches (columnar: the fastest to ingest)"
    )
    pc.add_argument("file")
    pc.add_argument("--out", required=True, help="output file (framed msgpack)")
    pc.add_argument("--batch", type=int, default=1024, help="calls per batch and execution")
    _format_args(pc)
    pc.set_defaults(func=cmd_compact)
    pb = sub.add_parser("bench", help="ingest/packing benchmark; prints one JSON object last")
    pb.add_argument("--quick", action="store_true", help="smaller workload (under a minute)")
    pb.add_argument("--out", default=None, help="also write the JSON result to this file")
    pb.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (RecordError, PackError, FileNotFoundError) as exc:
        print(f"gyre-traj: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
