"""A torch.distributed group for weight updates, formed the way SGLang forms its weight-update group.

SGLang's `/init_weights_update_group` makes every engine rank join a group of `world_size` ranks whose
rank 0 is the trainer: the trainer hosts a c10d `TCPStore` at `master_address:master_port`, engine ranks
are `rank_offset + tp_rank`, and the backend (NCCL there) rendezvouses through that store under the group
name. `/update_weights_from_distributed` then receives every tensor by a broadcast from rank 0, in the
order of the request's `names`. This module builds the same group on either side (the trainer as rank 0
in gyre-train, an engine rank in gyre-engine), without touching torch's default process group or its
registry of groups: the store and the backend object are private to one `WeightGroup`.

Store layout (so a member built here meets one built by torch's own group helper, which is what SGLang
and the trainers driving it use): the TCPStore, wrapped in `PrefixStore(group_name)`, then
`PrefixStore(group_name + "/")` and `PrefixStore(device + "/")` (`cpu` for gloo, `cuda` for NCCL).

Unlike the helper, every listening socket binds one address: rank 0's store binds `master_address`
(loopback by default), and each gloo rank listens on the local address that routes to the master.
Every wait has a deadline: forming the group (a rank that never comes), and each broadcast (a trainer
that never sends) raise `WeightGroupTimeout` instead of hanging; a broadcast can also be given up at once
(`give_up`, polled while it waits: rank 0 learns that an engine refused the update and will never
receive), raising `WeightGroupAborted`. No object ever crosses the group: only
raw tensor bytes, so nothing is unpickled.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")


class WeightGroupError(RuntimeError):
    """Forming the group or a broadcast failed (peer gone, refused, bad arguments)."""


class WeightGroupTimeout(WeightGroupError, TimeoutError):
    """A peer did not come, or rank 0 did not broadcast, within the group's timeout."""


class WeightGroupAborted(WeightGroupError):
    """A broadcast given up before it completed (its `give_up` said why); the group is out of step."""


def local_address_towards(host: str, port: int) -> str:
    """This host's address on the route to `host` (no packet is sent: a UDP socket is only connected)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    if not infos:
        raise WeightGroupError(f"cannot resolve {host!r}")
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return str(s.getsockname()[0])


def bind_master(address: str, port: int = 0) -> socket.socket:
    """A listening socket for rank 0's store on exactly `address` (port 0: a free one)."""
    infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
    family, _, _, _, addr = infos[0]
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(addr)
        s.listen(128)
    except OSError:
        s.close()
        raise
    return s


def _poll(work: Any, give_up: Callable[[], str | None], wait: dt.timedelta, what: str) -> None:
    """Wait for `work` until it completes, `give_up` returns a reason (WeightGroupAborted), or `wait`
    passes (then `work.wait` reports the timeout). Polls every 0.5 ms at first, backing off to 20 ms."""
    deadline = time.monotonic() + wait.total_seconds()
    pause = 0.0005
    while not work.is_completed() and time.monotonic() < deadline:
        why = give_up()
        if why is not None:
            raise WeightGroupAborted(f"{what}: given up: {why}")
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, TimeoutError) or "timed out" in text or "timeout" in text


class WeightGroup:
    """One member of a weight-update group. Rank 0 (the trainer) sends, every other rank receives.

    Build it with `WeightGroup.form(...)` on every member at about the same time: the constructor of the
    backend waits until all `world_size` ranks have joined (or `timeout_s` passes).
    """

    def __init__(
        self,
        name: str,
        rank: int,
        world_size: int,
        backend: str,
        timeout_s: float,
        store: dist.Store,
        backend_obj: object,
        device: torch.device,
    ) -> None:
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = timeout_s
        self.device = device
        """Where received tensors must live for this backend (CPU for gloo, the GPU for NCCL)."""
        self._store = store
        self._pg: object | None = backend_obj
        self._lock = threading.Lock()
        self.broadcasts = 0

    @staticmethod
    def form(
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str,
        backend: str = "gloo",
        timeout_s: float = 300.0,
        listener: socket.socket | None = None,
        cuda_device: torch.device | None = None,
    ) -> WeightGroup:
        """Join (rank > 0) or host (rank 0) the group. Rank 0 serves the store on `listener` if given
        (already bound and listening, e.g. by `bind_master`), else on a socket bound to exactly
        `master_address:master_port`. Raises WeightGroupTimeout when the others do not come in time."""
        if backend not in BACKENDS:
            raise WeightGroupError(f"backend {backend!r} is not supported; use one of {BACKENDS}")
        if world_size < 2 or not 0 <= rank < world_size:
            raise WeightGroupError(f"rank {rank} does not fit world_size {world_size} (needs >= 2 ranks)")
        if not group_name:
            raise WeightGroupError("group_name must not be empty")
        if timeout_s <= 0:
            raise WeightGroupError("timeout_s must be positive")
        if backend == "nccl" and (cuda_device is None or cuda_device.type != "cuda"):
            raise WeightGroupError("backend 'nccl' needs a CUDA device; use 'gloo' on the CPU")
        timeout = dt.timedelta(seconds=timeout_s)
        try:
            if rank == 0:
                sock = listener if listener is not None else bind_master(master_address, master_port)
                port = int(sock.getsockname()[1])
                fd = sock.detach()  # the store's server owns the listening socket from here on
                store: dist.Store = dist.TCPStore(
                    master_address,
                    port,
                    world_size,
                    True,
                    timeout,
                    wait_for_workers=False,
                    master_listen_fd=fd,
                )
            else:
                store = dist.TCPStore(master_address, master_port, world_size, False, timeout)
        except Exception as exc:
            kind = WeightGroupTimeout if _is_timeout(exc) else WeightGroupError
            raise kind(
                f"weight group {group_name!r}: store at {master_address}:{master_port} "
                f"(rank {rank} of {world_size}): {exc}"
            ) from exc
        store.set_timeout(timeout)
        device_tag = "cpu" if backend == "gloo" else "cuda"
        scoped = dist.PrefixStore(
            f"{device_tag}/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store))
        )
        try:
            if backend == "gloo":
                host = master_address if rank == 0 else local_address_towards(master_address, master_port)
                opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
                opts._timeout = timeout
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
                pg: object = dist.ProcessGroupGloo(scoped, rank, world_size, opts)
                device = torch.device("cpu")
            else:
                assert cuda_device is not None
                nopts = dist.ProcessGroupNCCL.Options()
                nopts._timeout = timeout
                pg = dist.ProcessGroupNCCL(scoped, rank, world_size, nopts)
                device = cuda_device
        except Exception as exc:
            kind = WeightGroupTimeout if _is_timeout(exc) else WeightGroupError
            raise kind(
                f"weight group {group_name!r}: rank {rank} of {world_size} could not connect to the "
                f"others within {timeout_s:g} s: {exc}"
            ) from exc
        return WeightGroup(group_name, rank, world_size, backend, timeout_s, store, pg, device)

    @property
    def closed(self) -> bool:
        return self._pg is None

    def broadcast(
        self,
        tensor: torch.Tensor,
        what: str = "tensor",
        timeout_s: float | None = None,
        give_up: Callable[[], str | None] | None = None,
    ) -> None:
        """Rank 0: send `tensor` to every rank. Others: receive rank 0's tensor into `tensor` (same shape
        and dtype, on `self.device`). Raises WeightGroupTimeout after `timeout_s` (default: the group's).
        `give_up`, polled while the broadcast is pending, returns a reason to stop waiting now
        (WeightGroupAborted; the group is then out of step) or None to go on."""
        pg = self._pg
        if pg is None:
            raise WeightGroupError(f"weight group {self.name!r} is closed")
        if not tensor.is_contiguous():
            raise WeightGroupError(f"{what}: broadcast needs a contiguous tensor")
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        wait = dt.timedelta(seconds=timeout_s if timeout_s is not None else self.timeout_s)
        with self._lock:
            try:
                work = pg.broadcast([tensor], opts)  # type: ignore[attr-defined]
                if give_up is not None:
                    _poll(work, give_up, wait, f"weight group {self.name!r}: {what}")
                work.wait(wait)
            except WeightGroupAborted:
                raise
            except Exception as exc:
                if _is_timeout(exc):
                    side = "send to the other ranks" if self.rank == 0 else "receive it from rank 0"
                    raise WeightGroupTimeout(
                        f"weight group {self.name!r}: {what}: could not {side} within "
                        f"{wait.total_seconds():g} s"
                    ) from exc
                raise WeightGroupError(f"weight group {self.name!r}: {what}: {exc}") from exc
            self.broadcasts += 1

    def close(self) -> None:
        """Drop the backend (its sockets close, so peers blocked on it fail rather than wait) and the store."""
        with self._lock:
            pg, self._pg = self._pg, None
            if pg is not None and hasattr(pg, "shutdown"):
                # best effort: a broken group may refuse an orderly shutdown
                with contextlib.suppress(Exception):
                    pg.shutdown()
            del pg
            self._store = None  # type: ignore[assignment]
