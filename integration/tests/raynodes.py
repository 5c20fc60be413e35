"""A Ray cluster of several nodes on this machine, for the tests: `ray start` once per node (a head and
nodes joining it, each its own raylet in its own session and temp dir), told apart by custom resources
(`gyre-<name>`), and a node's loss as it happens to a host that goes away (every process of that node
killed at once)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gyre_base.ports import free_port
from gyre_base.testing import env_without_token

_NODE_IDS = textwrap.dedent(
    """
    import json, sys
    import ray

    ray.init(address=sys.argv[1], log_to_driver=False, configure_logging=False)
    print(json.dumps({r: n["NodeID"] for n in ray.nodes() if n["Alive"] for r in n["Resources"]}))
    """
)


def stop_session(proc: subprocess.Popen[bytes], sig: signal.Signals = signal.SIGTERM) -> None:
    """`sig` to the session `proc` leads (a `ray start --block`: its raylet, GCS and workers), SIGKILL
    after 60 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@dataclass
class RayNodes:
    address: str
    env: dict[str, str]
    """The environment a client of the cluster needs."""
    nodes: dict[str, str]
    """`gyre-<name>` resource -> the node id Ray lists for it."""
    procs: dict[str, subprocess.Popen[bytes]]

    def kill(self, name: str) -> None:
        """Node `name` lost: SIGKILL to every process of its session at once (raylet, its workers; the
        processes gyre's actors started there die with their actor, by their parent-death signal)."""
        stop_session(self.procs[name], signal.SIGKILL)


@contextlib.contextmanager
def ray_nodes(cpus: dict[str, int], extra: dict[str, dict[str, int]] | None = None) -> Iterator[RayNodes]:
    """A cluster of `len(cpus)` nodes: the first is the head, each node `name` with `cpus[name]` logical
    CPUs, no GPU, the custom resource `gyre-<name>` as many as its CPUs and the custom resources
    `extra[name]` (one several nodes share lets Ray pick among them). Stopped on the way out."""
    env = {**env_without_token(), "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    ray_bin = str(Path(sys.executable).with_name("ray"))
    common = ["--block", "--num-gpus=0", "--disable-usage-stats"]
    started: dict[str, subprocess.Popen[bytes]] = {}
    port = free_port()
    address = f"127.0.0.1:{port}"
    try:
        for k, (name, n) in enumerate(cpus.items()):
            where = (
                ["--head", f"--port={port}", "--include-dashboard=false"]
                if k == 0
                else [f"--address={address}"]
            )
            temp = tempfile.mkdtemp(prefix=f"gyre-{name}-", dir="/tmp")  # short: socket paths have a limit
            log = Path(temp) / "start.log"
            argv = [ray_bin, "start", *where, f"--num-cpus={n}", *common]
            res = {f"gyre-{name}": n, **(extra or {}).get(name, {})}
            argv += [f"--resources={json.dumps(res)}", f"--temp-dir={temp}"]
            with open(log, "wb") as fh:
                node = subprocess.Popen(
                    argv, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
            started[name] = node
            deadline = time.monotonic() + 300
            while "Ray runtime started" not in log.read_text(errors="replace"):
                assert node.poll() is None, log.read_text(errors="replace")[-3000:]
                assert time.monotonic() < deadline, f"Ray node {name} did not start within 300 s"
                time.sleep(0.5)
        deadline = time.monotonic() + 300
        while True:
            p = subprocess.run(
                [sys.executable, "-c", _NODE_IDS, address], capture_output=True, env=env, timeout=300
            )
            assert p.returncode == 0, p.stderr.decode(errors="replace")[-3000:]
            nodes = json.loads(p.stdout.decode().strip().splitlines()[-1])
            if all(f"gyre-{n}" in nodes for n in cpus):
                break
            assert time.monotonic() < deadline, f"{len(cpus)} nodes did not join within 300 s: {nodes}"
            time.sleep(2.0)
        yield RayNodes(address, env, {f"gyre-{n}": nodes[f"gyre-{n}"] for n in cpus}, started)
    finally:
        for node in reversed(started.values()):
            stop_session(node)
