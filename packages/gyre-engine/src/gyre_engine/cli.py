"""`gyre-engine`: serve a model, create the embedded default model, print an SGLang launch command, bench.

Every subcommand imports torch only when it needs it, so `gyre-engine sglang-command` works from the
base install (client and launcher only).
"""

from __future__ import annotations

import argparse
import shlex
import sys

from gyre_base.token import TokenError, read_token_file

from gyre_engine import __version__
from gyre_engine.launcher import SGLangConfig


def _missing_server_extra(exc: ImportError) -> SystemExit:
    return SystemExit(f"{exc}: this command needs the server extra: pip install 'gyre-engine[server]'")


def _mib(value: float | None, default: int) -> int:
    return default if value is None else int(value * (1 << 20))


def _token_file(path: str | None) -> str:
    """The token in `--token-file` ("" without the flag); an unreadable or empty file exits 2."""
    if path is None:
        return ""
    try:
        return read_token_file(path)
    except TokenError as exc:
        print(f"gyre-engine: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _sglang_command(cfg: SGLangConfig, token_file: str | None) -> str:
    """The launch line, with the token read at run time (`$GYRE_TOKEN` or the file) instead of shown."""
    try:
        cmd, key = cfg.command(), cfg.token()
    except TokenError as exc:
        print(f"gyre-engine: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    line = shlex.join(cmd)
    if not key:
        return line
    source = f"$(head -n1 {shlex.quote(token_file)})" if token_file else "$GYRE_TOKEN"
    return line.replace(shlex.quote(key), f'"{source}"')


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="gyre-engine", description=__doc__)
    p.add_argument("--version", action="version", version=f"gyre-engine {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="serve a transformers model directory over SGLang's native protocol")
    s.add_argument("--model", required=True)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=30000)
    s.add_argument("--device", default="auto")
    s.add_argument("--dtype", default="auto")
    s.add_argument("--max-running-requests", type=int, default=64)
    s.add_argument("--max-cached-tokens", type=int, default=1 << 20)
    s.add_argument(
        "--host-cached-tokens",
        type=int,
        default=0,
        help="tokens of cached prefixes kept in host memory when they leave the device (past "
        "--max-cached-tokens, under --min-free-gib, or a long slot taken for another context), copied "
        "back when a call extends them instead of computed again (0: dropped)",
    )
    s.add_argument(
        "--min-free-gib",
        type=float,
        default=0.0,
        help="CUDA: GiB of the GPU (all processes) kept free; below it the prefix cache drops its least "
        "recently used entries first (0: off)",
    )
    s.add_argument(
        "--prefill-chunk",
        type=int,
        default=2048,
        help="tokens a step prefills at admission at most, and each chunk of a longer prefill "
        "(Engine.Config.prefill_chunk)",
    )
    s.add_argument(
        "--decode-slots",
        default="auto",
        choices=["auto", "graphs", "eager", "off"],
        help="decode in fixed slots of a static KV cache, captured as CUDA graphs (auto: on CUDA)",
    )
    s.add_argument("--no-compile-decode", action="store_true", help="capture the eager forward, uncompiled")
    s.add_argument(
        "--no-keep-graphs",
        action="store_true",
        help="free the weights and slot buffers on a memory release and capture their CUDA graphs again "
        "after it (default on CUDA: they keep their device addresses, and the graphs are kept)",
    )
    s.add_argument(
        "--pin-host-weights",
        action="store_true",
        help="allocate pinned host copies of the weights at start (CUDA): the first memory release is as "
        "fast as later ones",
    )
    s.add_argument(
        "--compile-prefill",
        action="store_true",
        help="on CUDA, run fresh prompts' prefill through torch.compile (the first requests wait minutes "
        "for the compilation)",
    )
    s.add_argument("--slot-kv-fraction", type=float, default=0.2, help="device memory for the slots' KV")
    s.add_argument(
        "--slot-widths",
        choices=["bucketed", "full"],
        default="bucketed",
        help="columns a decode step attends over: the longest row's length bucket (a graph per bucket, "
        "captured on first use) or the whole slot buffer (a graph per batch bucket, captured at warm-up)",
    )
    s.add_argument(
        "--long-context-tokens",
        type=int,
        default=None,
        help="tokens of each long slot: a context too long for a decode slot is prefilled chunk by chunk "
        "into a slot of its own and decodes there (default 0: none; Engine.Config.long_context_tokens)",
    )
    s.add_argument(
        "--long-context-slots",
        type=int,
        default=None,
        help="long slots (default 1): rows of one buffer, all allocated at the first long request, "
        "decoded in one step",
    )
    s.add_argument(
        "--prefill-share",
        type=float,
        default=None,
        help="share of the engine's time a chunked prefill gets while other requests decode (default 0.4)",
    )
    s.add_argument(
        "--prefill-graph-tokens",
        type=int,
        default=None,
        help="with --slot-widths full: prefix-cached calls whose new tokens come to at most this many "
        "together are prefilled straight into the decode slots as one CUDA graph replay (default 256; 0: off)",
    )
    s.add_argument(
        "--run-steps",
        type=int,
        default=8,
        help="decode steps per graph replay while no slot row needs truncation or logit processing "
        "(greedy or sampled at its temperature; 1: one step per replay)",
    )
    s.add_argument(
        "--warmup-decode-tokens",
        type=int,
        default=1024,
        help="with CUDA graphs: compile and capture the decode step for rows up to this length before "
        "serving (0: on first use)",
    )
    s.add_argument(
        "--allow-remote", action="store_true", help="allow a non-loopback --host (it also needs a token)"
    )
    s.add_argument(
        "--token-file",
        default=None,
        help="file whose first line is the run token: requests must carry it as `Authorization: Bearer` "
        "(default: $GYRE_TOKEN; required beyond loopback)",
    )
    s.add_argument(
        "--max-body-mb",
        type=float,
        default=None,
        help="longest request body in MiB, 413 past it (default 16; the two bulk paths: --max-bulk-body-mb)",
    )
    s.add_argument(
        "--max-bulk-body-mb",
        type=float,
        default=None,
        help="longest body of /update_weights_from_tensor and /import_prefix in MiB (default 4096)",
    )
    s.add_argument(
        "--sglang-only",
        action="store_true",
        help="serve SGLang's endpoints only (gyre's own answer 404): gyre-engine standing in for SGLang",
    )
    s.add_argument("--xfer-hostname", default="127.0.0.1", help="gyre-xfer: address Mooncake peers use")
    s.add_argument("--xfer-metadata-server", default="P2PHANDSHAKE", help="gyre-xfer: Mooncake metadata")
    s.add_argument(
        "--xfer-progress-timeout", type=int, default=5, help="gyre-xfer: seconds without progress = hung peer"
    )

    c = sub.add_parser("create-model", help="write the embedded default model (random init, local tokenizer)")
    c.add_argument("out_dir")
    c.add_argument("--shape", default="tiny", help="tiny (default), mini, small or qwen3-0.6b")
    c.add_argument(
        "--family", default="qwen3", choices=["qwen3", "qwen2", "llama"], help="architecture (default qwen3)"
    )
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--dtype", default="float32")

    g = sub.add_parser("sglang-command", help="print the command line that would launch a real SGLang server")
    g.add_argument("--model", required=True)
    g.add_argument("--tp", type=int, default=1)
    g.add_argument("--port", type=int, default=30000)
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--mem-fraction-static", type=float, default=None)
    g.add_argument(
        "--token-file",
        default=None,
        help="the run token for --api-key (default: $GYRE_TOKEN; required beyond loopback); the printed "
        "line reads it at run time (from the file or $GYRE_TOKEN) rather than showing it",
    )

    b = sub.add_parser("bench", help="benchmark; prints one JSON object as its last line")
    b.add_argument("--quick", action="store_true", help="tiny model only, small sizes (under a minute)")
    b.add_argument("--repeats", type=int, default=None, help="runs per measurement (default: the case's)")
    b.add_argument("--decode-slots", default="auto", choices=["auto", "graphs", "eager", "off"])
    b.add_argument("--no-compile-decode", action="store_true", help="capture the eager forward, uncompiled")
    b.add_argument("--device", default="cpu")
    b.add_argument("--out", default=None, help="also write the JSON here")

    args = p.parse_args(argv)
    if args.cmd == "sglang-command":
        cfg = SGLangConfig(
            model_path=args.model,
            tp=args.tp,
            port=args.port,
            host=args.host,
            mem_fraction_static=args.mem_fraction_static,
            api_key=_token_file(args.token_file),
        )
        print(_sglang_command(cfg, args.token_file))
        return
    try:
        if args.cmd == "serve":
            from gyre_engine.server.listen import listen_token

            listen_token(
                args.host, args.allow_remote, _token_file(args.token_file)
            )  # refused before torch loads
            from gyre_engine.server.engine import Engine
            from gyre_engine.server.serve import ServeConfig, serve
            from gyre_engine.server.xfer import XferConfig

            serve(
                ServeConfig(
                    model=args.model,
                    host=args.host,
                    port=args.port,
                    device=args.device,
                    dtype=args.dtype,
                    allow_remote=args.allow_remote,
                    sglang_only=args.sglang_only,
                    token=_token_file(args.token_file),
                    max_body_bytes=_mib(args.max_body_mb, ServeConfig.max_body_bytes),
                    max_bulk_body_bytes=_mib(args.max_bulk_body_mb, ServeConfig.max_bulk_body_bytes),
                    engine=Engine.Config(
                        max_running_requests=args.max_running_requests,
                        max_cached_tokens=args.max_cached_tokens,
                        host_cached_tokens=args.host_cached_tokens,
                        min_free_bytes=int(args.min_free_gib * (1 << 30)),
                        prefill_chunk=args.prefill_chunk,
                        decode_slots=args.decode_slots,
                        compile_decode=not args.no_compile_decode,
                        compile_prefill=args.compile_prefill,
                        pin_host_weights=args.pin_host_weights,
                        keep_graphs=not args.no_keep_graphs,
                        slot_kv_fraction=args.slot_kv_fraction,
                        slot_widths=args.slot_widths,
                        run_steps=args.run_steps,
                        **{
                            k: v
                            for k, v in (
                                ("long_context_tokens", args.long_context_tokens),
                                ("long_context_slots", args.long_context_slots),
                                ("prefill_share", args.prefill_share),
                                ("prefill_graph_tokens", args.prefill_graph_tokens),
                            )
                            if v is not None
                        },
                    ),
                    warmup_decode_tokens=args.warmup_decode_tokens,
                    xfer=XferConfig(
                        hostname=args.xfer_hostname,
                        metadata_server=args.xfer_metadata_server,
                        progress_timeout_s=args.xfer_progress_timeout,
                    ),
                )
            )
        elif args.cmd == "create-model":
            from gyre_engine.server.model_factory import create_model

            print(
                create_model(
                    args.out_dir, shape=args.shape, seed=args.seed, dtype=args.dtype, family=args.family
                )
            )
        elif args.cmd == "bench":
            from gyre_engine.bench.run import run_bench

            run_bench(
                quick=args.quick,
                device=args.device,
                out=args.out,
                repeats=args.repeats,
                decode_slots=args.decode_slots,
                compile_decode=not args.no_compile_decode,
            )
    except ImportError as exc:
        if exc.name in (
            "torch",
            "transformers",
            "uvicorn",
            "starlette",
            "tokenizers",
            "safetensors",
            "gyre_xfer",
        ):
            raise _missing_server_extra(exc) from exc
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
