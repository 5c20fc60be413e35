"""Placement through node agents over a shared directory: what a SLURM job (or any launcher that starts one
process per node) does with `gyre run` (`integration/examples/slurm/`).

Every node but the first runs `gyre node DIR --node-id K` (`NodeAgent`): it announces itself in
`DIR/K.json` (its address and a few ports free on it), then starts each process `gyre run` asks of it
(`DIR/K/NAME.start.json`: argv and environment, `{python}` standing for its own interpreter) in a
`ProcessGroup` (its output in the run's logs/, as on node 0), with the run token read from its token
file and the node's own CUDA_VISIBLE_DEVICES, and reports a process that exited
(`DIR/K/NAME.failed`: ChildDied's message, the tail of its log). It stops its processes and exits on
`DIR/stop` or SIGTERM (srun's at the end of the job).

On the first node `gyre run` uses `NodeLauncher` (`[run] nodes_dir`, `[run] node_agents`): the scheduler
and the proxy start here, the scheduler bound to `[run] bind_host`, the proxy to loopback (only the
harnesses in `gyre run` call it; the trajectory service's records PULL stays on loopback too); cell
i goes to node 1 + i mod node_agents, bound to that node's address. The directory must be on a filesystem
every node sees (so must the run's out_dir); files are written whole (a temporary name, then renamed).
Only argv lists and environment strings pass through it, as JSON; the token stays in its token file.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre_base.ports import free_port, free_ports
from gyre_base.token import TOKEN_ENV, resolve_token

from gyre.procs.group import ChildDied, ProcessGroup, tail
from gyre.system.launch import LOOPBACK

PYTHON = "{python}"
"""Stands for the interpreter in an argv sent to an agent: each node runs its own environment's Python."""
PORTS = 8
"""Ports each agent finds free on its node and announces (a cell takes one for its engine)."""


class NodeError(RuntimeError):
    """The node agents did not come up, or one is unusable."""


def _write(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)


class NodeAgent:
    """`gyre node`: one node's processes, as the first node's `gyre run` asks (module docstring)."""

    POLL_S = 0.2

    def __init__(self, nodes_dir: Path, node_id: int, host: str, token_file: str) -> None:
        self.dir, self.node_id, self.host = nodes_dir, node_id, host
        self.inbox = nodes_dir / str(node_id)
        self.inbox.mkdir(parents=True, exist_ok=True)
        self.token = Path(token_file).read_text().strip() if token_file else resolve_token()
        self.groups: dict[str, ProcessGroup] = {}
        """A group per log directory (the run's logs/, as `gyre run` names it)."""
        self.started: set[str] = set()
        self.reported: set[str] = set()
        self._stop = False

    def run(self) -> int:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "_stop", True))
        ports = free_ports(self.host, PORTS)
        _write(self.dir / f"{self.node_id}.json", {"host": self.host, "ports": ports, "pid": os.getpid()})
        try:
            while not self._stop and not (self.dir / "stop").exists():
                self._start_new()
                self._report()
                time.sleep(self.POLL_S)
        finally:
            for g in self.groups.values():
                g.close(10.0)
            _write(self.dir / f"{self.node_id}.stopped", {"pid": os.getpid()})
        return 0

    def _start_new(self) -> None:
        for f in sorted(self.inbox.glob("*.start.json")):
            name = f.name.removesuffix(".start.json")
            if name in self.started:
                continue
            doc = json.loads(f.read_text())
            argv = [sys.executable if a == PYTHON else str(a) for a in doc["argv"]]
            env = {str(k): str(v) for k, v in doc["env"].items()}
            if self.token:
                env[TOKEN_ENV] = self.token
            self.started.add(name)
            log_dir = str(doc["log_dir"])
            if log_dir not in self.groups:
                self.groups[log_dir] = ProcessGroup(Path(log_dir))
            pid = self.groups[log_dir].start(name, argv, env).proc.pid
            print(f"gyre node {self.node_id}: started {name} (pid {pid}) on {self.host}", flush=True)

    def _report(self) -> None:
        for c in (c for g in self.groups.values() for c in g.dead()):
            if c.name in self.reported:
                continue
            why = f"{c.name} exited with code {c.proc.returncode} on node {self.node_id} ({self.host}); "
            _write(self.inbox / f"{c.name}.failed", {"why": f"{why}last lines of {c.log}:\n{tail(c.log)}"})
            self.reported.add(c.name)


@dataclass
class _Node:
    node_id: int
    host: str
    ports: list[int]


@dataclass
class _Remote:
    name: str
    log: Path
    node: _Node


class NodeLauncher:
    """`gyre run` on the first node, the other nodes' processes through their agents (module docstring)."""

    def __init__(self, log_dir: Path, nodes_dir: Path, agents: int, bind_host: str, timeout_s: float) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir, self.dir = log_dir, nodes_dir
        self.local = ProcessGroup(log_dir)
        self.token = resolve_token()
        self.bind_host = bind_host
        self.children: list[Any] = []
        self._remote: list[_Remote] = []
        self._nodes = [self._await(k, timeout_s) for k in range(1, agents + 1)]
        (log_dir / "placement.json").write_text(
            json.dumps(
                {
                    "nodes_dir": str(nodes_dir),
                    "bind": bind_host,
                    "nodes": [{"node_id": n.node_id, "host": n.host} for n in self._nodes],
                },
                indent=1,
            )
        )

    def _await(self, k: int, timeout_s: float) -> _Node:
        f = self.dir / f"{k}.json"
        deadline = time.monotonic() + timeout_s
        while not f.exists():
            if time.monotonic() > deadline:
                raise NodeError(
                    f"node {k}'s agent did not announce itself in {f} within {timeout_s:.0f} s "
                    "([run] node_agents counts the nodes running `gyre node`)"
                )
            time.sleep(0.2)
        doc = json.loads(f.read_text())
        return _Node(k, str(doc["host"]), [int(p) for p in doc["ports"]])

    def _node(self, name: str) -> _Node | None:
        """The node a cell goes to; None for a part of this node (the scheduler, the proxy)."""
        if not name.startswith("cell-"):
            return None
        return self._nodes[int(name.removeprefix("cell-")) % len(self._nodes)]

    def host(self, name: str) -> str:
        """The proxy: loopback (only the harnesses in `gyre run` call it); the scheduler: `bind_host`."""
        node = self._node(name)
        if node is None:
            return LOOPBACK if name == "proxy" else self.bind_host
        return node.host

    def free_port(self, name: str) -> int:
        node = self._node(name)
        if node is None:
            return free_port(self.host(name))
        if not node.ports:
            raise NodeError(f"node {node.node_id} has no announced port left for {name}")
        return node.ports.pop(0)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> object:
        node = self._node(name)
        if node is None:
            child = self.local.start(name, argv, env)
            self.children.append(child)
            return child
        inbox = self.dir / str(node.node_id)
        (inbox / f"{name}.failed").unlink(missing_ok=True)
        argv = [PYTHON if a == sys.executable else a for a in argv]
        # the agent has the token; the node's GPUs are its own (SLURM's CUDA_VISIBLE_DEVICES)
        env = {k: v for k, v in (env or {}).items() if k not in (TOKEN_ENV, "CUDA_VISIBLE_DEVICES")}
        _write(inbox / f"{name}.start.json", {"argv": argv, "env": env, "log_dir": str(self.log_dir)})
        r = _Remote(name, self.log_dir / f"{name}.log", node)
        self._remote.append(r)
        self.children.append(r)
        return r

    def check(self) -> None:
        self.local.check()
        for r in self._remote:
            failed = self.dir / str(r.node.node_id) / f"{r.name}.failed"
            if failed.exists():
                raise ChildDied(json.loads(failed.read_text())["why"])

    def close(self) -> None:
        self.local.close()
        _write(self.dir / "stop", {"pid": os.getpid()})
        deadline = time.monotonic() + 30.0
        for n in self._nodes:
            while not (self.dir / f"{n.node_id}.stopped").exists() and time.monotonic() < deadline:
                time.sleep(0.2)
        for r in self._remote:
            with contextlib.suppress(OSError):
                (self.dir / str(r.node.node_id) / f"{r.name}.start.json").unlink()
