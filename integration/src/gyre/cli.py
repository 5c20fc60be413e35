"""The `gyre` command. Today it reports versions and points at the per-package commands; the
subcommands that start processes (`gyre run`, `gyre cell`, `gyre demo`) arrive with their issues."""

from __future__ import annotations

import argparse
import importlib.metadata
import sys

# Distributions that make up gyre; those not installed are shown as such.
_COMPONENTS = ("gyre", "gyre-traj", "gyre-proxy", "gyre-engine", "gyre-sched", "gyre-xfer", "gyre-train")


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
        epilog="Component commands: gyre-traj (trajectory trees, packing, loss). "
        "Run `gyre-traj --help` for its subcommands.",
    )
    parser.add_argument("--version", action="store_true", help="print the version of each gyre component")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("version", help="print the version of each gyre component")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.version or args.command == "version":
        for dist, version in _versions():
            print(f"{dist:<12} {version if version is not None else '(not installed)'}")
        return 0
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
