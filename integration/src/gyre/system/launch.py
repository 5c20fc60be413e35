"""Where the processes of a run start: this machine (`LocalLauncher`, the default) or a Ray cluster
(`RayLauncher`, the `gyre[ray]` extra, `[run] ray_address`).

A launcher knows the parts of a run by name before any starts (the scheduler, the proxy, each cell with
its GPU count). `host(name)` is the address of the node the part runs on, which its listeners bind and
its peers dial; `free_port(name)` a port free there now, below the kernel's ephemeral range (gyre-base's
`ports`: the kernel hands it to no other socket before the part binds it); `start(name, argv, env)` starts the
part's process on that node with its output in `log_dir/<name>.log`; `check()` raises `ChildDied`, naming
the part and the tail of its log, once any started process has exited; `close()` stops them all. `local`
is a `ProcessGroup` on this machine for one-off helpers (creating the model). `token` is the run token
every part is given as `$GYRE_TOKEN` ("" for a local run without one): the scheduler then binds its
CURVE listener (gyre_base.sockets) and every peer connects with it.

On Ray one placement group holds one bundle per part ({CPU: 1} plus the cell's GPUs), gang-reserved
before anything starts (PACK: as few nodes as fit), and one small actor per bundle, `Host`, starts the
part's process on its node through a `ProcessGroup` there, so the process dies with its actor (the
kernel's parent-death signal) and the actor with the run's Ray driver (`gyre run`). The actor sees the
bundle's GPUs (Ray sets CUDA_VISIBLE_DEVICES) and the process inherits them. Ray carries only argv
lists, environment strings and log tails between the driver and the actors; gyre's own traffic goes
over its ZeroMQ and HTTP endpoints as it does locally. `log_dir` and the run directory must be on a
filesystem every node sees (as on SLURM clusters), since cells write `core.json` and `steps.jsonl` there.
Where each part landed is written to `log_dir/placement.json`.

`check()` never waits on a node: it asks every started part's actor whether its process lives and reads
the answers that have come back (`ray.wait`, no blocking); a part whose process exited, whose actor died,
whose actor cannot be reached while Ray lists its node dead, or that has not answered for
`PEER_TIMEOUT_S` is lost, `PartLost` naming the part and its node (an actor Ray cannot reach on a node it
still lists alive is asked again: a blip of the network is no loss). The run
decides what a loss means (attempt.py: a satellite cell is let go with `let_go` and the run goes on, any
other part ends the attempt). A placement that asks for a custom resource no live node has is refused at
once, naming the part and the resource (the node that had it was lost), rather than waiting for it. A bundle also asks for the part's custom
resources (`[run] ray_resources`), which pin it to the nodes that have them. A placement that fits on
the node of `gyre run` itself stays on loopback (nothing listens beyond the machine); one that spans
nodes binds each part's node address, where the token is what keeps others out, except the proxy: only
the harnesses in `gyre run` call it, so it must share that node and stays on loopback (`bind_hosts`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from gyre_base import ports
from gyre_base.token import TOKEN_ENV, new_token, resolve_token

from gyre.config.runconfig import RunSection
from gyre.procs.group import ChildDied, ProcessGroup

LOOPBACK = "127.0.0.1"
_THIS_PYTHON = "{python}"
"""Stands for the interpreter in an argv sent to a Host: each node runs its own environment's Python."""


class PlacementError(RuntimeError):
    """The cluster cannot place the run's parts (not enough CPUs or GPUs, or Ray is unreachable)."""


class PartLost(ChildDied):
    """A part placed on Ray is gone: its process exited, its actor died, or its node stopped answering."""

    def __init__(self, part: str, node_id: str, message: str, alive_at: float = 0.0) -> None:
        super().__init__(message)
        self.part = part
        self.node_id = node_id
        self.alive_at = alive_at
        """When (wall clock) its actor last said its process lives; 0: unknown."""


@dataclass(frozen=True)
class Part:
    """One placed process of a run."""

    name: str
    gpus: int = 0
    resources: dict[str, float] = field(default_factory=dict)
    """Ray custom resources its bundle asks for besides CPU and GPU (`[run] ray_resources`)."""


def bundle_of(part: Part) -> dict[str, float]:
    """The placement-group bundle of `part`: one CPU, its GPUs, its custom resources (which pin it to the
    nodes that have them)."""
    return {"CPU": 1.0, **({"GPU": float(part.gpus)} if part.gpus else {}), **part.resources}


def bind_hosts(names: Sequence[str], nodes: Sequence[tuple[str, str]], driver_node: str) -> list[str]:
    """The address each part binds, from where the parts landed (`(node id, node address)` each) and the
    node of `gyre run`: loopback for all when every part is on the driver's node, else each one's node
    address; the proxy always loopback, on the driver's node (only the harnesses in `gyre run` call it,
    and gyre-proxy listens beyond loopback only with per-execution API keys)."""
    one_node = all(node_id == driver_node for node_id, _ in nodes)
    hosts = []
    for name, (node_id, address) in zip(names, nodes, strict=True):
        if name == "proxy" and node_id != driver_node:
            raise PlacementError(
                f"the proxy landed on node {node_id} ({address}), not on the node of gyre run "
                f"({driver_node}): it listens on loopback for the harnesses there; "
                "[run] ray_resources.proxy should name a resource of that node"
            )
        hosts.append(LOOPBACK if one_node or name == "proxy" else address)
    return hosts


class Logged(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def log(self) -> Path: ...


class Launcher(Protocol):
    token: str

    @property
    def local(self) -> ProcessGroup:
        """A group on this machine for one-off helpers."""
        ...

    @property
    def children(self) -> Sequence[Logged]:
        """The started parts, each with its name and log file."""
        ...

    def host(self, name: str) -> str: ...

    def free_port(self, name: str) -> int: ...

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> object: ...

    def check(self) -> None: ...

    def close(self) -> None: ...


class LocalLauncher(ProcessGroup):
    """Every part on this machine, bound to loopback (the default; what `gyre run` always did)."""

    def __init__(self, log_dir: Path) -> None:
        super().__init__(log_dir)
        self.token = resolve_token()
        self.local = self

    def host(self, name: str) -> str:
        return LOOPBACK

    def free_port(self, name: str) -> int:
        return ports.free_port(LOOPBACK)


def launcher_for(run: RunSection, log_dir: Path, parts: list[Part], token_made: bool = True) -> Launcher:
    """`[run]`'s launcher on this machine or Ray: a `RayLauncher` with `parts` placed for `ray_address`
    (the run token in `$GYRE_TOKEN`; `token_made`: the run made it, none was given), else the local one.
    (`[run] node_agents` is `nodeagent.NodeLauncher`'s.)"""
    if run.ray_address:
        return RayLauncher(run.ray_address, log_dir, parts, run.startup_timeout_s, token_made)
    return LocalLauncher(log_dir)


class Host:
    """A Ray actor on one bundle: starts and watches one part's process on its node (module docstring).
    Plain methods on plain values, so the class also runs as is (tests call it in-process)."""

    def __init__(self, log_dir: str) -> None:
        self.procs = ProcessGroup(Path(log_dir))

    def node(self) -> tuple[str, str]:
        """(Ray node id, the node's address)."""
        import ray

        return str(ray.get_runtime_context().get_node_id()), str(ray.util.get_node_ip_address())

    def free_port(self, host: str) -> int:
        return ports.free_port(host)

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> int:
        argv = [sys.executable if a == _THIS_PYTHON else a for a in argv]
        return int(self.procs.start(name, argv, env).proc.pid)

    def failure(self) -> str | None:
        """Why a started process is gone (ChildDied's message: name, exit code, tail of its log), or None."""
        try:
            self.procs.check()
        except ChildDied as exc:
            return str(exc)
        return None

    def stop(self, timeout_s: float) -> None:
        self.procs.close(timeout_s)


@dataclass
class _Placed:
    name: str
    log: Path
    actor: Any
    host: str
    node_id: str = ""
    started: bool = False
    probe: Any = None
    """The pending `failure()` call on its actor, if any."""
    answered_at: float = 0.0
    """When (monotonic) its actor last answered (or was asked first)."""
    alive_at: float = 0.0
    """The same on the wall clock."""


class RayLauncher:
    """Parts placed on a Ray cluster through one placement group (module docstring)."""

    CHECK_EVERY_S = 0.5
    PEER_TIMEOUT_S = 30.0
    """A started part's actor that has not answered for this long is lost (its node is unreachable)."""

    def __init__(
        self, address: str, log_dir: Path, parts: list[Part], timeout_s: float, token_made: bool = True
    ) -> None:
        # The parts run in the Ray nodes' own Python environment (gyre installed there), never in one Ray
        # rebuilds for each worker from the driver's `uv run` (its default: `uv run` per worker process,
        # with the driver's working directory uploaded).
        os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError as exc:
            raise PlacementError(
                "[run] ray_address needs Ray: install the extra, `pip install 'gyre[ray]'`"
            ) from exc
        self._ray = ray
        self.address = address
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.local = ProcessGroup(log_dir)
        self._own_token = not resolve_token()
        self._token_made = token_made or self._own_token
        self.token = resolve_token() or new_token()
        os.environ[TOKEN_ENV] = self.token  # this process's own peers (driver, sampler) use it too
        self._placed: dict[str, _Placed] = {}
        self._pg: Any = None
        self._checked = 0.0
        self.children: list[_Placed] = []
        """Started parts (`name`, `log`), as `ProcessGroup.children`."""
        try:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
        except Exception as exc:
            raise PlacementError(f"cannot reach the Ray cluster at {address!r}: {exc}") from exc
        try:
            self._place(parts, timeout_s, placement_group, PlacementGroupSchedulingStrategy)
        except BaseException:
            self.close()
            raise

    def _place(self, parts: list[Part], timeout_s: float, placement_group: Any, strategy: Any) -> None:
        ray = self._ray
        _check_resources_exist(parts, [n for n in ray.nodes() if n.get("Alive")])
        bundles = [bundle_of(p) for p in parts]
        self._pg = placement_group(bundles, strategy="PACK", name=f"gyre-{os.getpid()}")
        ready, deadline = self._pg.ready(), time.monotonic() + timeout_s
        while not ray.wait([ready], timeout=min(2.0, max(0.0, deadline - time.monotonic())))[0]:
            if time.monotonic() < deadline:  # a node lost meanwhile: refused now, not at the deadline
                _check_resources_exist(parts, [n for n in ray.nodes() if n.get("Alive")])
                continue
            free = {k: v for k, v in ray.available_resources().items() if not k.startswith("node:")}
            raise PlacementError(
                f"the Ray cluster could not place {bundles} within {timeout_s:.0f} s "
                f"(available now: {', '.join(f'{k} {v:g}' for k, v in sorted(free.items()))}; "
                "[run] ray_resources names the custom resources each part asks for)"
            )
        remote = ray.remote(Host)
        for i, p in enumerate(parts):
            actor = remote.options(
                num_cpus=1,
                num_gpus=p.gpus,
                scheduling_strategy=strategy(placement_group=self._pg, placement_group_bundle_index=i),
                name=None,
            ).remote(str(self.log_dir))
            self._placed[p.name] = _Placed(p.name, self.log_dir / f"{p.name}.log", actor, "")
        nodes = ray.get([pl.actor.node.remote() for pl in self._placed.values()], timeout=timeout_s)
        here = str(ray.get_runtime_context().get_node_id())
        here_ip = str(ray.util.get_node_ip_address())
        hosts = bind_hosts([p.name for p in parts], nodes, here)
        self.one_node = all(node_id == here for node_id, _ in nodes)
        for pl, h, (node_id, _) in zip(self._placed.values(), hosts, nodes, strict=True):
            pl.host, pl.node_id = h, node_id
        where: list[dict[str, Any]] = [
            dict(
                name=p.name, bind=h, node_id=n, node_address=ip, gpus=p.gpus, resources=bundle_of(p), bundle=i
            )
            for i, (p, h, (n, ip)) in enumerate(zip(parts, hosts, nodes, strict=True))
        ]
        doc = {
            "ray_address": self.address,
            "driver_node_id": here,
            "driver": {"node_id": here, "node_address": here_ip},
            "one_node": self.one_node,
            "run_token": "new" if self._token_made else "given",
            "parts": where,
        }
        (self.log_dir / "placement.json").write_text(json.dumps(doc, indent=1))

    def _part(self, name: str) -> _Placed:
        if name not in self._placed:
            raise PlacementError(f"{name} is not one of the placed parts ({', '.join(self._placed)})")
        return self._placed[name]

    def host(self, name: str) -> str:
        return self._part(name).host

    def node_of(self, name: str) -> str:
        """The Ray node id `name` was placed on."""
        return self._part(name).node_id

    def free_port(self, name: str) -> int:
        pl = self._part(name)
        return int(self._ray.get(pl.actor.free_port.remote(pl.host), timeout=60))

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> object:
        pl = self._part(name)
        env = {k: v for k, v in (env or {}).items() if k != "CUDA_VISIBLE_DEVICES"}  # Ray assigns GPUs
        argv = [_THIS_PYTHON if a == sys.executable else a for a in argv]
        self._ray.get(pl.actor.start.remote(name, argv, {**env, TOKEN_ENV: self.token}), timeout=60)
        pl.started = True
        self.children.append(pl)
        return pl

    def check(self) -> None:
        """Raise `PartLost` once any started part's process, its actor or its node is gone (module
        docstring); never waits on an actor."""
        self.local.check()
        now = time.monotonic()
        if now - self._checked < self.CHECK_EVERY_S:
            return
        self._checked = now
        ray = self._ray
        if not self.children:
            return
        for pl in self.children:
            if pl.probe is None:
                pl.probe = pl.actor.failure.remote()
                if not pl.answered_at:
                    pl.answered_at, pl.alive_at = now, time.time()
        probes = [pl.probe for pl in self.children]
        answered, _ = ray.wait(probes, num_returns=len(probes), timeout=0)
        done = {ref.hex() for ref in answered}
        for pl in list(self.children):
            if pl.probe.hex() not in done:
                if now - pl.answered_at > self.PEER_TIMEOUT_S:
                    raise PartLost(
                        pl.name,
                        pl.node_id,
                        f"{pl.name}: its Ray actor on node {pl.node_id} ({pl.host}) has not answered for "
                        f"{self.PEER_TIMEOUT_S:.0f} s (its node is unreachable)",
                        pl.alive_at,
                    )
                continue
            ref, pl.probe = pl.probe, None
            try:
                why = ray.get(ref, timeout=10)
            except ray.exceptions.ActorUnavailableError as exc:  # unreachable: lost if its node is dead
                if self._node_alive(pl.node_id):
                    continue
                msg = f"{pl.name}: its Ray node {pl.node_id} ({pl.host}) is dead and its actor unreachable"
                raise PartLost(
                    pl.name, pl.node_id, f"{msg}: {str(exc).splitlines()[0]}", pl.alive_at
                ) from exc
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                msg = f"{pl.name}: its Ray actor on node {pl.node_id} ({pl.host}) is gone ({type(exc).__name__})"
                raise PartLost(
                    pl.name, pl.node_id, f"{msg}: {str(exc).splitlines()[0]}", pl.alive_at
                ) from exc
            if why is not None:
                raise PartLost(pl.name, pl.node_id, f"{why} (on node {pl.node_id}, {pl.host})", pl.alive_at)
            pl.answered_at, pl.alive_at = now, time.time()

    def _node_alive(self, node_id: str) -> bool:
        """Whether Ray's GCS lists the node `node_id` alive."""
        return any(n.get("NodeID") == node_id and n.get("Alive") for n in self._ray.nodes())

    def let_go(self, name: str) -> None:
        """Stop watching the lost part `name` and end its actor (no wait: its node may be gone)."""
        pl = self._part(name)
        if pl in self.children:
            self.children.remove(pl)
        with contextlib.suppress(Exception):
            self._ray.kill(pl.actor)

    def close(self) -> None:
        """Stop every part (SIGTERM, then SIGKILL), end the actors, free the bundles, leave the cluster."""
        ray = self._ray
        self.local.close()
        with contextlib.suppress(Exception):
            ray.get([pl.actor.stop.remote(10.0) for pl in reversed(self.children)], timeout=30)
        for pl in self._placed.values():
            with contextlib.suppress(Exception):
                ray.kill(pl.actor)
        self._placed.clear()
        self.children.clear()
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self._pg)
            self._pg = None
        with contextlib.suppress(Exception):
            ray.shutdown()
        if self._own_token:
            os.environ.pop(TOKEN_ENV, None)


def _check_resources_exist(parts: Sequence[Part], alive: Sequence[dict[str, Any]]) -> None:
    """PlacementError naming the first part whose custom resource no live node has (as `ray.nodes()`
    lists them): such a bundle could never be placed (the node that had it was lost, or none ever had)."""
    have = {k for n in alive for k in n.get("Resources", {})}
    for p in parts:
        missing = sorted(k for k in p.resources if k not in have)
        if missing:
            raise PlacementError(
                f"{p.name} asks for the Ray resource {missing[0]!r}, which no live node of the cluster has "
                f"(its node was lost, or none has it); place it elsewhere with [run] ray_resources "
                "(`gyre run --resume DIR --ray-resources JSON` continues an unfinished run so placed)"
            )
