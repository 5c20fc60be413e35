"""`gyre-train`: run a core, a satellite, or the benchmark.

gyre-train core --synthetic 3 --admit-all --checkpoint ckpt/    # prints its address, then a JSON line per step
gyre-train core --model Qwen2.5-0.5B/ --feed ...               # a model directory's architecture and weights
gyre-train satellite --core tcp://127.0.0.1:PORT --name sat-0
gyre-train export ckpt/ model-out/ --tokenizer model-in/     # a checkpoint as a Hugging Face model directory
gyre-train mismatch model-dir/ [--device cuda]                # engine vs trainer logprobs on one directory
gyre-train bench [--quick] [--device cuda]

A multi-rank cell: every rank runs the same command under torchrun's environment, e.g.
python -m gyre_train.launch --nproc 2 -m gyre_train.cli core --tp 2 --model-backend megatron ...
torchrun --nproc-per-node 2 -m gyre_train.cli satellite --tp 2 --backend nccl --device cuda ...
Rank 0 runs the core (or satellite); the other ranks follow it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from gyre_base.token import TokenError
from gyre_traj.loss import LossConfig
from gyre_traj.pack import PackConfig

from gyre_train import __version__
from gyre_train.defaults import MISMATCH_WARN


def _token(args: argparse.Namespace) -> str:
    """The run token of `--token-file`, or "" (then $GYRE_TOKEN, or none)."""
    from gyre_base.token import read_token_file

    return read_token_file(args.token_file) if args.token_file else ""


def _cell(args: argparse.Namespace) -> Any:
    """This rank's cell when the command asks for more than one rank (else None)."""
    from gyre_train.cell import ParallelConfig, join_cell

    cfg = ParallelConfig(
        tp=args.tp,
        pp=args.pp,
        dp=args.dp,
        backend=args.backend,
        control_host=args.control_host,
        token=_token(args),
    )
    if cfg.world == 1:
        return None
    return join_cell(cfg)


def _follow_unless_leader(cell: Any) -> int | None:
    """On a rank other than 0: serve rank 0 until it stops, and return the exit status."""
    if cell is None or cell.rank == 0:
        return None
    from gyre_train.follower import follow

    try:
        return follow(cell)
    finally:
        cell.close()


def _core(args: argparse.Namespace) -> int:
    from gyre_train.core import Core, CoreConfig, OptimConfig
    from gyre_train.data import read_packed_dir, synthetic_minibatch
    from gyre_train.model import ModelConfig, build_model
    from gyre_train.modelconfig import ModelConfigError

    try:  # on every rank, before the cell forms: a refused config ends them all alike
        if args.model:
            mc = ModelConfig.from_model_dir(
                args.model, seed=args.seed, dtype=args.dtype, backend=args.model_backend
            )
        else:
            mc = ModelConfig(seed=args.seed, dtype=args.dtype or "float32", backend=args.model_backend)
    except ModelConfigError as exc:
        print(f"gyre-train core: {exc}", file=sys.stderr)
        return 2
    cell = _cell(args)
    status = _follow_unless_leader(cell)
    if status is not None:
        return status
    cfg = CoreConfig(
        bind=args.bind,
        token=_token(args),
        transport=args.transport,
        token_budget=args.budget,
        attention=args.attention,
        wire_dtype=args.wire_dtype,
        admit_on_hello=args.admit_all,
        loss=LossConfig(mode=args.loss, ppo_tis_cap=args.tis_cap),
        optim=OptimConfig(lr=args.lr),
        mismatch_warn=args.mismatch_warn,
    )
    device = str(cell.device(args.device)) if cell is not None else args.device
    core = Core(build_model(mc, cfg.attention, device), mc, cfg, cell)
    try:
        ckpt = Path(args.checkpoint) if args.checkpoint else None
        if ckpt is not None and (ckpt / "state.json").exists():
            core.load(ckpt)
        elif args.model:
            from gyre_train.model import pretrained_weights

            core.load_whole_weights(pretrained_weights(mc, args.model))
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
        if cell is not None:
            cell.close()
    return 0


def _satellite(args: argparse.Namespace) -> int:
    from gyre_train.satellite import Satellite, SatelliteConfig

    cell = _cell(args)
    status = _follow_unless_leader(cell)
    if status is not None:
        return status
    sat = Satellite(
        SatelliteConfig(
            core=args.core,
            name=args.name,
            token=_token(args),
            device=args.device,
            reply_timeout_s=args.reply_timeout_s,
            idle_exit_s=args.idle_exit_s,
            crash_after_claims=args.crash_after_claims,
            warmup=args.warmup,
        ),
        cell,
    )
    print(json.dumps({"ready": args.name, "warmup_s": sat.warmup_s}), flush=True)
    try:
        n = sat.run()
    finally:
        sat.close()
        if cell is not None:
            cell.close()
    print(json.dumps({"name": args.name, "microbatches": n, "version": sat.version}), flush=True)
    return 0


def _export(args: argparse.Namespace) -> int:
    from gyre_train.export import ExportError, export_checkpoint

    try:
        print(export_checkpoint(Path(args.checkpoint), Path(args.out), Path(args.tokenizer)))
    except ExportError as exc:
        print(f"gyre-train export: {exc}", file=sys.stderr)
        return 2
    return 0


def _mismatch(args: argparse.Namespace) -> int:
    from gyre_train.mismatch import MismatchConfig, measure
    from gyre_train.modelconfig import ModelConfigError

    cfg = MismatchConfig(
        model_dir=args.model_dir,
        device=args.device,
        dtype=args.dtype,
        samples=args.samples,
        new_tokens=args.new_tokens,
        attention=args.attention,
        decode_slots=args.decode_slots,
        backend=args.model_backend,
    )
    try:
        print(json.dumps(measure(cfg)), flush=True)
    except (ModelConfigError, FileNotFoundError) as exc:
        print(f"gyre-train mismatch: {exc}", file=sys.stderr)
        return 2
    return 0


def _mismatch_args(p: argparse.ArgumentParser) -> None:
    from gyre_train.mismatch import MismatchConfig as M

    p.add_argument("model_dir", help="a Hugging Face model directory (config.json, *.safetensors, tokenizer)")
    p.add_argument("--device", default=M.device, help="cpu or cuda (cuda:N): both sides")
    p.add_argument(
        "--dtype",
        default=M.dtype,
        choices=["float32", "bfloat16", "auto"],
        help="both sides' parameter dtype",
    )
    p.add_argument("--samples", type=int, default=M.samples, help="continuations the engine samples")
    p.add_argument("--new-tokens", type=int, default=M.new_tokens, help="tokens per continuation")
    p.add_argument("--attention", default=M.attention, choices=["dense", "flex"], help="the trainer's")
    p.add_argument(
        "--decode-slots",
        default=M.decode_slots,
        choices=["auto", "graphs", "eager", "off"],
        help="the engine's decode path (auto: CUDA graphs on a GPU, lanes on the CPU)",
    )
    p.add_argument(
        "--model-backend",
        default=M.backend,
        choices=["transformers", "megatron"],
        help="the trainer's backend",
    )


def _bench(args: argparse.Namespace) -> int:
    from gyre_train.bench.run import main as bench_main

    return bench_main(args)


def _cell_args(p: argparse.ArgumentParser) -> None:
    from gyre_train.cell import ParallelConfig

    d = ParallelConfig()
    g = p.add_argument_group("multi-rank cell (every rank runs this command under torchrun's environment)")
    g.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel ranks (Megatron-core)")
    g.add_argument("--pp", type=int, default=d.pp, help="pipeline stages (Megatron-core)")
    g.add_argument("--dp", type=int, default=d.dp, help="data-parallel copies")
    g.add_argument("--backend", default=d.backend, choices=["gloo", "nccl"], help="torch.distributed backend")
    g.add_argument(
        "--control-host", default=d.control_host, help="where rank 0 binds the in-cell control sockets"
    )


def _token_flag(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--token-file",
        default="",
        help=f"file whose first line is the run token ({what}); without it, $GYRE_TOKEN, or none",
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="gyre-train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--version", action="version", version=f"gyre-train {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("core", help="run the core replica over synthetic or packed mini-batches")
    c.add_argument("--bind", default="tcp://127.0.0.1:0", help="ROUTER address (beyond loopback: a token)")
    _token_flag(c, "needed to bind beyond loopback; satellites and clients must hold the same token")
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
    c.add_argument(
        "--budget",
        type=int,
        default=PackConfig.token_budget,
        help="tokens in one micro-batch: the largest the core accepts, and the synthetic mini-batches' packing "
        "budget (default: gyre-traj's PackConfig, %(default)s)",
    )
    c.add_argument("--attention", default="dense", choices=["dense", "flex"])
    c.add_argument("--device", default="cpu")
    c.add_argument("--loss", default="ppo", choices=["ppo", "tis"])
    c.add_argument(
        "--tis-cap",
        type=float,
        default=LossConfig.ppo_tis_cap,
        help="--loss ppo: truncated importance sampling of the train-inference mismatch, each token weighted "
        "by min(exp(trainer - behaviour logprob), cap) (gyre-traj's LossConfig.ppo_tis_cap; default "
        "%(default)s: off)",
    )
    c.add_argument(
        "--mismatch-warn",
        type=float,
        default=MISMATCH_WARN,
        help="warn for a step whose on-policy tokens' mean |trainer - behaviour logprob| is above this "
        "(0: never; default %(default)s)",
    )
    c.add_argument("--lr", type=float, default=1e-4)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--admit-all", action="store_true", help="admit every satellite that says hello")
    c.add_argument("--wait-satellites", type=int, default=0, help="wait for this many satellites first")
    c.add_argument("--wait-satellites-s", type=float, default=60.0)
    c.add_argument("--checkpoint", help="directory: resume from it if present, save after every step")
    c.add_argument("--model-backend", default="transformers", choices=["transformers", "megatron"])
    c.add_argument(
        "--model",
        default="",
        help="a Hugging Face model directory (Qwen2/Qwen2.5, Qwen3, Llama): its whole config and its weights "
        "(default: the embedded default's Qwen3, from random init)",
    )
    c.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="parameter dtype (default: the --model checkpoint's; float32 from scratch)",
    )
    _cell_args(c)
    c.set_defaults(fn=_core)
    s = sub.add_parser("satellite", help="run a satellite replica of a core")
    s.add_argument("--core", required=True)
    s.add_argument("--name", required=True)
    _token_flag(s, "the core's")
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
    _cell_args(s)
    s.set_defaults(fn=_satellite)
    e = sub.add_parser(
        "export", help="a checkpoint as a Hugging Face model directory (transformers, engines)"
    )
    e.add_argument("checkpoint", help="a checkpoint directory (`--checkpoint` of `core`, Core.save)")
    e.add_argument("out", help="the model directory to write")
    e.add_argument(
        "--tokenizer",
        required=True,
        help="model directory with the tokenizer (the one training started from)",
    )
    e.set_defaults(fn=_export)
    m = sub.add_parser(
        "mismatch",
        help="load a model directory in gyre-engine and in the trainer, print their logprob difference (JSON)",
    )
    _mismatch_args(m)
    m.set_defaults(fn=_mismatch)
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
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except TokenError as exc:  # no token for a bind beyond loopback, an unreadable token file
        print(f"gyre-train {args.cmd}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
