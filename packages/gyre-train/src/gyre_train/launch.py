"""Start the ranks of one cell on this host, as torchrun does:

    python -m gyre_train.launch --nproc 2 -m gyre_train.cli core --tp 2 --synthetic 3 ...
    python -m gyre_train.launch --nproc 2 path/to/program.py ARGS

Every rank runs the same target (a module with `-m`, or a script) as `__main__`, with torchrun's
environment: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR (127.0.0.1) and MASTER_PORT (a
free port unless set). The launcher imports torch (and `--preload` modules: megatron-core's import alone
takes about 15 s of CPU) once, then forks the ranks, so they start at once; nothing crosses a process
boundary but the environment. If a rank fails, the others are sent SIGTERM (SIGKILL after
`--grace-s`) and the launcher exits with the failed rank's status, as torchrun does. Across hosts, use
torchrun or the cluster's launcher (`srun`): gyre-train reads the same variables.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import runpy
import signal
import sys
import time

from gyre_base.ports import free_port

PRELOAD = {
    "torch": ("torch",),
    "megatron": ("torch", "gyre_train.megatron"),
    "transformers": ("torch", "transformers"),
}


def _run_rank(rank: int, nproc: int, port: int, module: str | None, argv: list[str]) -> int:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        MASTER_PORT=str(port),
    )
    sys.argv = [module or argv[0], *argv[(0 if module else 1) :]]
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0


def launch(nproc: int, module: str | None, argv: list[str], grace_s: float = 10.0) -> int:
    """Fork `nproc` ranks running `module` (or the script `argv[0]`) with `argv`; wait for all of them.
    Returns 0 if every rank exited 0, else the first failure's status (128 + signal for a signal)."""
    port = int(os.environ.get("MASTER_PORT") or free_port())
    pids: dict[int, int] = {}
    for rank in range(nproc):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the rank: run the target, then leave without running the launcher's cleanup
            status = 1
            try:
                status = _run_rank(rank, nproc, port, module, argv)
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        pids[pid] = rank
    while pids:
        pid, st = os.wait()
        if pid not in pids:
            continue
        rank = pids.pop(pid)
        code = os.waitstatus_to_exitcode(st)
        if code != 0:
            sys.stderr.write(f"gyre_train.launch: rank {rank} exited with {code}; stopping the others\n")
            _stop(set(pids), grace_s)
            return code if code > 0 else 128 - code
    return 0


def _stop(pids: set[int], grace_s: float) -> None:
    """SIGTERM to every rank left, SIGKILL to those still alive after `grace_s`; all of them reaped."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        pids -= {pid for pid in pids if _reaped(pid)}
        time.sleep(0.05)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def _reaped(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return done != 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gyre_train.launch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--nproc", type=int, required=True, help="ranks to start (the cell's world size)")
    ap.add_argument(
        "--preload",
        default="torch",
        help="comma-separated modules imported before forking: torch, megatron, transformers, or any module",
    )
    ap.add_argument("--grace-s", type=float, default=10.0, help="SIGTERM to SIGKILL when a rank fails")
    ap.add_argument("-m", dest="module", help="run this module as __main__ (as python -m does)")
    ap.add_argument("target", nargs=argparse.REMAINDER, help="script and its arguments, or the module's")
    args = ap.parse_args(argv)
    if not args.module and not args.target:
        ap.error("give -m MODULE or a script")
    for name in filter(None, args.preload.split(",")):
        for mod in PRELOAD.get(name, (name,)):
            importlib.import_module(mod)
    return launch(args.nproc, args.module, args.target, args.grace_s)


if __name__ == "__main__":
    sys.exit(main())
