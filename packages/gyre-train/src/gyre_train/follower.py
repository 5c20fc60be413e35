"""A cell's rank other than 0: it waits for rank 0's `RankSetup`, builds its part of the role's model
(`CoreRank` or `SatelliteRank`), then does each command rank 0 sends, in order, until `Stop`. A core rank
also serves satellites' gradient reads (`Fetch`) on a thread of its own, so a read never waits behind a
computation. A command that fails is answered with the reason and ends the process (exit 1): its peers
may be inside a collective it will never join, and the launcher (torchrun, `gyre_train.launch`) takes the
whole cell down, as it does for any rank that dies.
"""

from __future__ import annotations

import logging
import threading
import traceback
from typing import Any

import msgspec
from gyre_traj.loss import LossConfig
from gyre_traj.pack import PackedBatch

from gyre_train.cell import Cell
from gyre_train.cellctl import FetchEnd
from gyre_train.corerank import MOMENTS, CoreRank, OptimConfig, RankWork
from gyre_train.handoff import BadShardError, ShardTransferError
from gyre_train.model import Attention, ModelConfig, build_model
from gyre_train.protocol import (
    Apply,
    Compute,
    Fetch,
    Gather,
    LoadWeights,
    Publish,
    Pull,
    RankFailure,
    RankReply,
    RankSetup,
    RoundItem,
    Stop,
    SyncWeights,
)
from gyre_train.satrank import SatelliteRank, SatWork
from gyre_train.threads import start_thread
from gyre_train.wire import from_frames, microbatch_from_arrays

log = logging.getLogger("gyre_train.follower")


def round_items(items: tuple[RoundItem, ...], frames: list[Any]) -> list[tuple[int, int, PackedBatch]]:
    """The micro-batches of a `Compute` from its frames: (data-parallel index, index, micro-batch)."""
    out = []
    at = 0
    for it in items:
        arrays = from_frames(it.arrays, [f.buffer for f in frames[at : at + len(it.arrays)]])
        out.append((it.dp, it.index, microbatch_from_arrays(arrays)))
        at += len(it.arrays)
    return out


def rank_work(setup: RankSetup, token: str = "") -> RankWork:
    """`token`: this rank's own run token (the cell's setting; never sent over the link)."""
    return RankWork(
        loss=msgspec.json.decode(setup.loss, type=LossConfig),
        attention=_attention(setup.attention),
        chunk_budget=setup.chunk_budget,
        transport=setup.transport,
        wire_dtype=setup.wire_dtype,
        transfer_timeout_s=setup.transfer_timeout_s,
        optim=msgspec.json.decode(setup.optim, type=OptimConfig),
        token=token,
    )


def sat_work(setup: RankSetup, rank: int, token: str = "") -> SatWork:
    return SatWork(
        loss=msgspec.json.decode(setup.loss, type=LossConfig),
        attention=_attention(setup.attention),
        chunk_budget=setup.chunk_budget,
        transport=setup.transport,
        wire_dtype=setup.wire_dtype,
        bucket_bytes=setup.bucket_bytes,
        publisher=setup.publishers[rank],
        verify_checksums=setup.verify_checksums,
        token=token,
    )


def _attention(name: str) -> Attention:
    return "flex" if name == "flex" else "dense"


def follow(cell: Cell) -> int:
    """Serve rank 0 until it says `Stop`; returns the process's exit status."""
    link = cell.follower
    assert link is not None
    got = None
    while got is None:  # rank 0 builds its own model first; the watchdog ends us if it died
        got = link.recv(1.0)
    setup, _ = got
    if not isinstance(setup, RankSetup):
        raise RuntimeError(f"rank {cell.rank}: expected the setup first, got {type(setup).__name__}")
    mc = ModelConfig.from_json(setup.model_config)
    model = build_model(mc, _attention(setup.attention), str(cell.device(setup.device)))
    stop = threading.Event()
    fetcher = None
    worker: CoreRank | SatelliteRank
    if setup.role == "core":
        worker = CoreRank(model, rank_work(setup, cell.cfg.token), cell)
        fetch_end = link.take_fetch()
        core = worker
        fetcher = start_thread(lambda: _serve_fetches(core, fetch_end, cell.rank, stop), "gyre-train-fetch")
        link.reply(RankReply(cell.rank, publisher=worker.publisher.address))
    else:
        worker = SatelliteRank(model, sat_work(setup, cell.rank, cell.cfg.token), cell)
        link.reply(RankReply(cell.rank))
    try:
        while True:
            got = link.recv(1.0)
            if got is None:
                continue
            cmd, frames = got
            try:
                reply = _do(worker, cmd, frames, cell.rank)
            except Exception:
                link.reply(RankReply(cell.rank, RankFailure.FAILED, traceback.format_exc()))
                raise
            link.reply(reply)
            if isinstance(cmd, Stop):
                return 0
    finally:
        stop.set()
        if fetcher is not None:
            fetcher.join(timeout=5.0)
        worker.close()


def _do(worker: CoreRank | SatelliteRank, cmd: Any, frames: list[Any], rank: int) -> RankReply:
    """Do one command of rank 0's training thread on this rank."""
    if isinstance(cmd, Stop):
        return RankReply(rank)
    if isinstance(cmd, Compute):
        items = round_items(cmd.items, frames)
        if isinstance(worker, CoreRank):
            return RankReply(rank, metrics=tuple(worker.compute(cmd.batch, items)))
        metrics, shards = worker.compute(items)
        return RankReply(rank, metrics=tuple(metrics), shards=tuple(shards))
    if isinstance(cmd, Pull) and isinstance(worker, SatelliteRank):
        seconds = worker.pull(cmd.snapshot)
        return RankReply(rank, version=worker.snapshot, value=seconds)
    if isinstance(cmd, Apply) and isinstance(worker, CoreRank):
        return RankReply(rank, value=worker.apply(cmd.batch, cmd.n, cmd.executions))
    if isinstance(cmd, Publish) and isinstance(worker, CoreRank):
        return RankReply(rank, version=worker.publish())
    if isinstance(cmd, SyncWeights) and isinstance(worker, CoreRank):
        worker.sync_state()
        return RankReply(rank)
    if isinstance(cmd, LoadWeights) and isinstance(worker, CoreRank):
        if cmd.what == "weights":
            worker.load_whole(None)
        else:
            worker.load_whole_moment(cmd.what, None, cmd.step)
        return RankReply(rank)
    if isinstance(cmd, Gather) and isinstance(worker, CoreRank):
        if cmd.what == "gradient":
            worker.whole_gradient(cmd.batch, cmd.n, 1)
        elif cmd.what in MOMENTS:
            worker.whole_moment(cmd.what)
        else:
            worker.whole({n: p.detach() for n, p in worker.model.named_parameters()})
        return RankReply(rank)
    raise RuntimeError(f"rank {rank}: {type(cmd).__name__} is not a command for a {type(worker).__name__}")


def _serve_fetches(worker: CoreRank, end: FetchEnd, rank: int, stop: threading.Event) -> None:
    """Read satellites' shards into this rank's sum as rank 0's server thread asks."""
    try:
        while not stop.is_set():
            cmd = end.recv(0.2)
            if not isinstance(cmd, Fetch):
                continue
            try:
                worker.fetch(cmd.batch, cmd.index, cmd.shard, cmd.whole)
                end.reply(RankReply(rank, seq=cmd.seq))
            except BadShardError as exc:
                end.reply(RankReply(rank, RankFailure.BAD_SHARD, str(exc), seq=cmd.seq))
            except ShardTransferError as exc:
                end.reply(RankReply(rank, RankFailure.TRANSFER, str(exc), seq=cmd.seq))
            except Exception as exc:
                log.exception("rank %d: fetch of micro-batch %d failed", rank, cmd.index)
                end.reply(RankReply(rank, RankFailure.FAILED, f"{type(exc).__name__}: {exc}", seq=cmd.seq))
    finally:
        end.close()
