"""`gyre-proxy`: serve the proxy, or run its benchmark.

`gyre-proxy serve --tokenizer MODEL_DIR --engine URL ...` listens on 127.0.0.1 unless `--allow-remote`;
`gyre-proxy bench [--quick]` prints one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="gyre-proxy", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser(
        "serve", help="serve the Anthropic and OpenAI APIs in front of SGLang-protocol engines"
    )
    s.add_argument("--tokenizer", required=True, help="model directory or tokenizer.json of the policy")
    s.add_argument("--engine", action="append", default=[], help="engine URL (repeatable)")
    s.add_argument(
        "--sched", default="", help="gyre-sched endpoint (engines added/drained/removed from there)"
    )
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8080)
    s.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --host")
    s.add_argument("--record-log", default="", help="append-only msgpack TITO log (fsynced per call)")
    s.add_argument("--record-push", default="", help="ZeroMQ endpoint to PUSH records to")
    s.add_argument("--api-keys", default="", help="JSON file {key: execution_id}; other keys get 401")
    s.add_argument("--model-name", default="gyre-policy")
    s.add_argument("--max-context", type=int, default=40960)
    s.add_argument("--drain-grace", type=float, default=0.0)
    s.add_argument("--pick-wait", type=float, default=5.0)
    b = sub.add_parser("bench", help="benchmark; prints one JSON object as its last line")
    b.add_argument("--quick", action="store_true", help="smaller sizes, under a minute")
    b.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)

    if args.cmd == "bench":
        from gyre_proxy.bench.run import run_bench

        res = run_bench(quick=args.quick)
        line = json.dumps(res)
        if args.out:
            with open(args.out, "w") as fh:
                fh.write(json.dumps(res, indent=2) + "\n")
        print(line)
        return

    import uvicorn

    from gyre_proxy.app import build_app
    from gyre_proxy.core import Proxy, ProxyConfig

    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.allow_remote:
        sys.exit(f"refusing to listen on {args.host}: not loopback (pass --allow-remote)")
    keys: dict[str, str] = {}
    if args.api_keys:
        with open(args.api_keys) as fh:
            keys = {str(k): str(v) for k, v in json.load(fh).items()}
    if args.host not in ("127.0.0.1", "localhost", "::1") and not keys:
        sys.exit("a non-loopback listener needs --api-keys")
    cfg = ProxyConfig(
        tokenizer=args.tokenizer,
        model_name=args.model_name,
        engines=tuple(args.engine),
        record_log=args.record_log,
        record_push=args.record_push,
        api_keys=keys,
        max_context_tokens=args.max_context,
        drain_grace_s=args.drain_grace,
        pick_wait_s=args.pick_wait,
    )
    uvicorn.run(build_app(Proxy(cfg), args.sched), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
