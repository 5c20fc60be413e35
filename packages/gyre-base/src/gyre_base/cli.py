"""The `gyre-base` command: `token` prints a new random run token (for `GYRE_TOKEN` or a `--token-file`),
`bench [--quick] [--out FILE]` measures what the token costs a ZeroMQ link (needs the `zmq` extra), and
`--version` prints gyre-base's version."""

from __future__ import annotations

import argparse

from gyre_base import __version__
from gyre_base.token import new_token


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gyre-base", description=__doc__)
    p.add_argument("--version", action="version", version=f"gyre-base {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("token", help="print a new random run token (256 bits, 43 URL-safe characters)")
    b = sub.add_parser("bench", help="a ZeroMQ echo with and without the token (CURVE + ZAP), side by side")
    b.add_argument("--quick", action="store_true", help="fewer repetitions (seconds)")
    b.add_argument("--out", help="also write the JSON result, indented, to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "token":
        print(new_token())
    elif args.cmd == "bench":
        from gyre_base.bench.sockets import main as bench_main

        bench_main(args.quick, args.out)
    return 0
