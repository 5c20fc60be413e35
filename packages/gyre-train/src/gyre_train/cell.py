"""A cell that is a multi-rank job: a core or a satellite as one torch.distributed group of
tp x pp x dp processes (tensor, pipeline and data parallelism).

`ParallelConfig` says how the model is split; `RankEnv` is how a process learns its place (torchrun's
variables: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); `join_cell` starts the process group
(gloo on CPUs; on GPUs NCCL for tensors on the device and gloo for CPU tensors), Megatron's model-parallel
groups when tp or pp is above one, and the in-cell control link: rank 0 binds its ZeroMQ sockets and
sends their addresses to the other ranks over the group. Rank 0 runs the core's or the satellite's
protocol (`Core(..., cell=cell)`, `Satellite(..., cell=cell)`); every other rank runs `follower.follow`,
doing what rank 0 asks, its part of every collective included. Every rank runs the same program.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import msgspec
import torch

from gyre_train.cellctl import FollowerLink, LeaderLink, LinkAddresses
from gyre_train.defaults import PIPELINE_PARALLEL, TENSOR_PARALLEL
from gyre_train.protocol import CellShape
from gyre_train.shards import ShardPlan

BACKENDS = {"gloo": "gloo", "nccl": "cpu:gloo,cuda:nccl"}


class CellError(RuntimeError):
    """A cell that cannot start or whose ranks disagree."""


@dataclass(frozen=True)
class ParallelConfig:
    """How a cell splits its model over its ranks (world size = tp * pp * dp)."""

    tp: int = TENSOR_PARALLEL
    """Tensor-parallel ranks (Megatron-core backend)."""
    pp: int = PIPELINE_PARALLEL
    """Pipeline stages (Megatron-core backend)."""
    dp: int = 1
    """Data-parallel copies: each computes its own micro-batch of a round."""
    backend: str = "gloo"
    """"gloo" (CPU ranks) or "nccl" (one GPU per rank: NCCL for tensors on the GPU, gloo on the CPU)."""
    control_host: str = "127.0.0.1"
    """Where rank 0 binds the in-cell control sockets (the node's address when ranks span nodes; beyond
    loopback it needs a token)."""
    reply_timeout_s: float = 600.0
    """Longest rank 0 waits for every rank to finish one command (a silent rank is an error)."""
    heartbeat_s: float = 1.0
    """How often rank 0 tells the other ranks it is alive."""
    dead_after_s: float = 60.0
    """A rank that hears nothing from rank 0 this long ends its process (status 70)."""
    collective_timeout_s: float = 1800.0
    """torch.distributed's timeout for one collective."""
    token: str = field(default="", repr=False)
    """The run token of the in-cell link and of this rank's gyre-xfer sockets (every rank has its own copy
    of the setting); empty: $GYRE_TOKEN, or none (loopback only)."""

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def shape(self) -> CellShape:
        return CellShape(self.tp, self.pp, self.dp)


@dataclass(frozen=True)
class RankEnv:
    """This process's place, from torchrun's environment variables."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    @staticmethod
    def from_env(env: Mapping[str, str] | None = None) -> RankEnv:
        e = os.environ if env is None else env
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in e]
        if missing:
            raise CellError(
                f"a multi-rank cell needs torchrun's environment ({', '.join(missing)} unset): start it with "
                "`torchrun --nproc-per-node N ...` or `python -m gyre_train.launch --nproc N ...`"
            )
        return RankEnv(
            int(e["RANK"]),
            int(e["WORLD_SIZE"]),
            int(e.get("LOCAL_RANK", e["RANK"])),
            e["MASTER_ADDR"],
            int(e["MASTER_PORT"]),
        )


class _Hello(msgspec.Struct, frozen=True, array_like=True):
    tp: int
    pp: int
    dp: int
    backend: str
    link: LinkAddresses


@dataclass
class Cell:
    """This process's view of its cell: its rank, its coordinates and groups, and its end of the link."""

    cfg: ParallelConfig
    env: RankEnv
    leader: LeaderLink | None
    """Rank 0's end of the in-cell link (None on the other ranks)."""
    follower: FollowerLink | None
    """The other ranks' end (None on rank 0)."""

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world(self) -> int:
        return self.env.world_size

    @property
    def megatron(self) -> bool:
        """Megatron's model-parallel groups are this cell's (tp or pp above one)."""
        return self.cfg.tp * self.cfg.pp > 1

    def device(self, kind: str) -> torch.device:
        """This rank's device for a model on `kind` ("cpu" or "cuda": cuda:LOCAL_RANK)."""
        return torch.device(f"cuda:{self.env.local_rank}") if kind == "cuda" else torch.device("cpu")

    @property
    def dp_index(self) -> int:
        if self.megatron:
            from megatron.core import parallel_state

            return int(parallel_state.get_data_parallel_rank())
        return self.rank

    @property
    def dp_group(self) -> Any:
        """The group of this rank's data-parallel copies (None: the whole cell)."""
        if self.megatron:
            from megatron.core import parallel_state

            return parallel_state.get_data_parallel_group()
        return None

    def dp_ranks(self) -> list[int]:
        """Global ranks of this rank's data-parallel group, by data-parallel index."""
        group = self.dp_group
        if group is None:
            return list(range(self.world))
        return list(torch.distributed.get_process_group_ranks(group))

    def close(self) -> None:
        if self.leader is not None:
            self.leader.close()
        if self.follower is not None:
            self.follower.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def shard_plan(numel: int, cell: Cell | None) -> ShardPlan:
    """This rank's slice of its data-parallel group's gradients (the whole vector without one)."""
    if cell is None or cell.cfg.dp == 1:
        return ShardPlan(numel)
    return ShardPlan(numel, cell.cfg.dp, cell.dp_index, cell.dp_group, tuple(cell.dp_ranks()))


def join_cell(cfg: ParallelConfig, env: RankEnv | None = None) -> Cell:
    """Start this rank's part of the cell (every rank calls it, with the same `cfg`): the process group,
    Megatron's groups when needed, and the in-cell link. Rank 0's `cfg` is checked against every rank's."""
    env = env or RankEnv.from_env()
    if env.world_size != cfg.world:
        raise CellError(
            f"tp {cfg.tp} x pp {cfg.pp} x dp {cfg.dp} = {cfg.world} ranks, but WORLD_SIZE={env.world_size}"
        )
    if cfg.backend not in BACKENDS:
        raise CellError(f"backend {cfg.backend!r} is not one of {sorted(BACKENDS)}")
    if cfg.backend == "nccl":
        torch.cuda.set_device(env.local_rank)
    torch.distributed.init_process_group(
        BACKENDS[cfg.backend],
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=cfg.collective_timeout_s),
    )
    leader = (
        LeaderLink(cfg.control_host, env.world_size, cfg.heartbeat_s, cfg.token) if env.rank == 0 else None
    )
    hello = _Hello(
        cfg.tp, cfg.pp, cfg.dp, cfg.backend, leader.addresses if leader else LinkAddresses("", "", "")
    )
    got = msgspec.msgpack.decode(_broadcast(msgspec.msgpack.encode(hello)), type=_Hello)
    if (got.tp, got.pp, got.dp, got.backend) != (cfg.tp, cfg.pp, cfg.dp, cfg.backend):
        raise CellError(f"rank {env.rank}: this rank has {cfg}, rank 0 has {got}")
    follower = None
    if leader is None:
        follower = FollowerLink(got.link, env.rank, cfg.dead_after_s, cfg.token)
    else:
        leader.wait_followers(cfg.reply_timeout_s)
    if cfg.tp * cfg.pp > 1:
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(cfg.tp, cfg.pp, create_gloo_process_groups=False)
    return Cell(cfg, env, leader, follower)


def _broadcast(payload: bytes) -> bytes:
    """Rank 0's bytes on every rank (over the CPU: gloo)."""
    n = torch.tensor([len(payload)], dtype=torch.int64)
    torch.distributed.broadcast(n, 0)
    buf = (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if payload
        else torch.empty(0, dtype=torch.uint8)
    )
    if torch.distributed.get_rank() != 0:
        buf = torch.empty(int(n.item()), dtype=torch.uint8)
    torch.distributed.broadcast(buf, 0)
    return bytes(buf.numpy())
