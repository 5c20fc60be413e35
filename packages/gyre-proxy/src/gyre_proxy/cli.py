"""`gyre-proxy`: serve the proxy, or run its benchmark.

`gyre-proxy serve` takes one flag per `ProxyConfig` field (derived from it: `gyre-proxy serve --help`
lists them with their defaults). It listens on 127.0.0.1 unless `--allow-remote`, and beyond loopback
only with `--api-keys`. `gyre-proxy bench [--quick]` prints one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from gyre_proxy import __version__


def parser() -> argparse.ArgumentParser:
    """`gyre-proxy`'s flags; `serve`'s are derived from `ProxyConfig`."""
    from gyre_proxy.config import ProxyConfig
    from gyre_proxy.flags import add_flags

    p = argparse.ArgumentParser(prog="gyre-proxy", description=__doc__)
    p.add_argument("--version", action="version", version=f"gyre-proxy {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser(
        "serve", help="serve the Anthropic and OpenAI APIs in front of SGLang-protocol engines"
    )
    add_flags(s, ProxyConfig)
    b = sub.add_parser("bench", help="benchmark; prints one JSON object as its last line")
    b.add_argument("--quick", action="store_true", help="smaller sizes, under a minute")
    b.add_argument("--out", default=None, help="also write the JSON here")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
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
    serve(args)


def serve(args: argparse.Namespace) -> None:
    import uvicorn
    from gyre_base.sockets import derive_keys
    from gyre_base.token import TokenError, resolve_token

    from gyre_proxy.app import build_app
    from gyre_proxy.config import KEEP_ALIVE_S, ConfigError, ProxyConfig
    from gyre_proxy.core import Proxy
    from gyre_proxy.flags import config_from

    try:
        cfg = config_from(ProxyConfig, args)
        token = resolve_token(cfg.token)
        if token:
            derive_keys(token)  # a weak token is refused now, before anything starts
        app = build_app(Proxy(cfg))
    except (ConfigError, TokenError, FileNotFoundError, ValueError) as exc:
        sys.exit(f"gyre-proxy: {exc}")
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S)


if __name__ == "__main__":
    main()
