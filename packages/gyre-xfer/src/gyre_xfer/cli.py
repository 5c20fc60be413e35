"""The `gyre-xfer` command: `bench [--quick]` (one JSON object as the last line), `doctor` (can this
machine run Mooncake, and does a loopback transfer move bytes exactly) and `token` (a new run token)."""

from __future__ import annotations

import argparse
import json
import sys

from . import __version__


def _doctor() -> int:
    import numpy as np

    from .errors import TransportUnavailableError
    from .mooncake import installed_wheel
    from .transport import Config, Op, open_transport

    report: dict[str, object] = {"gyre_xfer": __version__, "mooncake_wheel": installed_wheel()}
    try:
        a = open_transport(Config(kind="mooncake"))
        b = open_transport(Config(kind="mooncake"))
    except TransportUnavailableError as e:
        report["mooncake"] = f"unavailable: {e}"
        print(json.dumps(report))
        return 1
    src = b.alloc(1 << 20)
    assert src.array is not None
    src.array[:] = np.arange(1 << 20) % 251
    dst = a.alloc(1 << 20)
    res = a.read(b.endpoint, [Op(dst, 0, src.desc, 0, 1 << 20)])
    report["mooncake"] = "ok" if res.ok and dst.array is not None and (dst.array == src.array).all() else res
    report["endpoints"] = [a.endpoint, b.endpoint]
    print(json.dumps(report, default=str))
    a.close()
    b.close()
    return 0 if report["mooncake"] == "ok" else 1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="gyre-xfer", description=__doc__)
    parser.add_argument("--version", action="version", version=f"gyre-xfer {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench", help="throughput of the wrapper next to raw Mooncake, TCP, memcpy, shm")
    b.add_argument("--quick", action="store_true", help="fewer repetitions (under a minute)")
    b.add_argument("--out", help="also write the JSON result, indented, to this file")
    sub.add_parser("doctor", help="check that Mooncake imports and moves bytes over loopback")
    sub.add_parser("token", help="print a new random run token (for GYRE_TOKEN or a --token-file)")
    args = parser.parse_args(argv)
    if args.cmd == "bench":
        from .bench.run import main as bench_main

        bench_main(args.quick, args.out)
    elif args.cmd == "doctor":
        sys.exit(_doctor())
    elif args.cmd == "token":
        from gyre_base.token import new_token

        print(new_token())
