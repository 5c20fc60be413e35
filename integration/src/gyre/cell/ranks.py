"""The ranks of a multi-rank cell (`[cell] tensor_parallel`, `pipeline_parallel`): the cell's process is
rank 0 of one torch.distributed job (gyre-train's `join_cell`: gloo on the CPU) and starts ranks 1 to
N - 1 as its children, each `python -m gyre.cell.ranks` under torchrun's variables (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT), which joins the cell and follows rank 0 (`gyre_train.follower`)
until rank 0 stops it. A rank that dies is a dead child of the cell, which ends the cell; a cell that
dies takes its ranks with it (the kernel's parent-death signal, and gyre-train's heartbeat watchdog).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING

from gyre_base.ports import free_port

from gyre.cell.args import CellArgs
from gyre.procs.group import ProcessGroup, python_argv

if TYPE_CHECKING:
    from gyre_train.cell import Cell, ParallelConfig


def parallel_config(tp: int, pp: int, control_host: str) -> ParallelConfig:
    """The cell's split, the same on every rank (gloo: CPU ranks; the token is $GYRE_TOKEN, or none)."""
    from gyre_train.cell import ParallelConfig

    return ParallelConfig(tp=tp, pp=pp, backend="gloo", control_host=control_host)


def start_cell(a: CellArgs, procs: ProcessGroup) -> Cell:
    """Rank 0's side (the cell's process): start ranks 1 to N - 1 (`cell-<id>.rank<r>` in `procs`), then
    join the cell with them. Returns rank 0's `Cell`, for gyre-train's `Core` or `Satellite`."""
    from gyre_train.cell import RankEnv, join_cell

    world, port = a.ranks, free_port()
    env = {"WORLD_SIZE": str(world), "MASTER_ADDR": a.host, "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    args = ["--tp", str(a.tensor_parallel), "--pp", str(a.pipeline_parallel), "--control-host", a.host]
    for r in range(1, world):
        procs.start(
            f"cell-{a.cell_id}.rank{r}",
            python_argv("gyre.cell.ranks", *args),
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
        )
    cfg = parallel_config(a.tensor_parallel, a.pipeline_parallel, a.host)
    return join_cell(cfg, RankEnv(0, world, 0, a.host, port))


def main(argv: list[str] | None = None) -> int:
    """A rank other than 0: join the cell, follow rank 0 until it stops, return the exit status."""
    p = argparse.ArgumentParser(prog="python -m gyre.cell.ranks", description=__doc__)
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--pp", type=int, required=True)
    p.add_argument("--control-host", required=True)
    ns = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import torch
    from gyre_train.cell import join_cell
    from gyre_train.devmem import use_expandable_segments
    from gyre_train.follower import follow

    torch.set_num_threads(1)
    use_expandable_segments()
    cell = join_cell(parallel_config(ns.tp, ns.pp, ns.control_host))
    logging.getLogger("gyre.cell.ranks").info(
        "rank %d of %d (pid %d) joined: tp %d, pp %d", cell.rank, cell.world, os.getpid(), ns.tp, ns.pp
    )
    try:
        return follow(cell)
    finally:
        cell.close()


if __name__ == "__main__":
    sys.exit(main())
