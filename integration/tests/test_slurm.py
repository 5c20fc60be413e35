"""The SLURM example (`integration/examples/slurm/`) run on this machine: its per-node command, `node.sh`,
started three times as srun would start it on three nodes (SLURM_JOB_NODELIST, SLURM_NNODES, SLURM_NODEID
and SLURM_PROCID set by hand; every node's address is 127.0.0.1). Node 0 makes the token and runs `gyre
run` (scheduler, proxy, driver, trajectory service); nodes 1 and 2 run `gyre node` agents, which start
cell 0 and cell 1. No srun, no second host: what crosses between the "nodes" is what would between hosts
(the shared job directory, the token file, ZeroMQ and HTTP with the run token)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gyre_base.testing import env_without_token

ROOT = Path(__file__).resolve().parents[2]
NODE_SH = ROOT / "integration" / "examples" / "slurm" / "node.sh"
TINY = ROOT / "integration" / "examples" / "tiny.toml"


def _node_env(job: Path, node_id: int) -> dict[str, str]:
    bin_dir = Path(sys.executable).parent  # this environment's console scripts
    return {
        **env_without_token(),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "node[0-2]",
        "SLURM_NNODES": "3",
        "SLURM_NODEID": str(node_id),
        "SLURM_PROCID": str(node_id),
        "SLURM_LOCALID": "0",
        "GYRE_CONFIG": str(TINY),
        "GYRE_JOB_DIR": str(job),
        "GYRE": str(bin_dir / "gyre"),
        "GYRE_XFER": str(bin_dir / "gyre-xfer"),
        "GYRE_HOST": "127.0.0.1",
        "OMP_NUM_THREADS": "1",
    }


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_slurm_example_node_script_runs_tiny_on_three_nodes(tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir()
    logs = tmp_path / "node-logs"
    logs.mkdir()
    nodes: list[subprocess.Popen[bytes]] = []
    args = ["run.startup_timeout_s=900.0", "run.deadline_s=1800.0"]
    try:
        for k in (1, 2, 0):  # the agents first: they wait for node 0's token
            with open(logs / f"node{k}.log", "wb") as fh:
                nodes.append(
                    subprocess.Popen(
                        ["bash", str(NODE_SH), *(args if k == 0 else [])],
                        stdout=fh,
                        stderr=subprocess.STDOUT,
                        env=_node_env(job, k),
                        start_new_session=True,
                    )
                )
        head = nodes[-1]
        rc = head.wait(2400)
        said = {k: (logs / f"node{k}.log").read_text(errors="replace") for k in range(3)}
        assert rc == 0, said[0][-5000:]
        for agent in nodes[:2]:  # gyre run's end (nodes/stop) ends the agents, their cells stopped
            assert agent.wait(120) == 0
    finally:
        for n in nodes:
            if n.poll() is None:
                os.killpg(n.pid, signal.SIGKILL)
                n.wait(10)
    run = job / "run"
    m = json.loads((run / "metrics.json").read_text())
    assert m["steps_applied"] == 2 and m["final_version"] == 2
    rollout = [c for c in m["final_cells"].values() if c["role"] == "rollout"]
    assert rollout and all(c["engine_version"] == "2" for c in rollout)
    placed = json.loads((run / "logs" / "placement.json").read_text())
    assert [n["node_id"] for n in placed["nodes"]] == [1, 2]
    assert "gyre node 1: started cell-0" in said[1] and "gyre node 2: started cell-1" in said[2]
    assert "cell-" not in said[0]  # node 0 started no cell itself
    assert (run / "logs" / "cell-0.log").stat().st_size > 0 and (run / "logs" / "sched.log").exists()
    assert (job / "token").stat().st_mode & 0o077 == 0  # the token file is the job owner's alone


def test_node_agent_starts_a_part_and_names_its_death_with_its_log_tail(tmp_path: Path) -> None:
    """`gyre node` (a real process) announces itself, starts the cell `NodeLauncher` gives it with the
    token from its token file, reports its exit (`ChildDied`: name, code, node, log tail) and stops
    once the launcher closes."""
    from gyre.procs.group import ChildDied
    from gyre.system.nodeagent import NodeLauncher

    nodes, logs = tmp_path / "nodes", tmp_path / "logs"
    token = tmp_path / "token"
    token.write_text("t" * 40 + "\n")
    argv = [sys.executable, "-m", "gyre.cli", "node", str(nodes), "--node-id", "1"]
    argv += ["--host", "127.0.0.1", "--token-file", str(token)]
    said = tmp_path / "agent.log"
    with open(said, "wb") as fh:
        agent = subprocess.Popen(
            argv, stdout=fh, stderr=subprocess.STDOUT, env=env_without_token(), start_new_session=True
        )
    launcher = NodeLauncher(logs, nodes, 1, "127.0.0.1", 120.0)
    try:
        assert launcher.host("cell-0") == "127.0.0.1" and launcher.host("proxy") == "127.0.0.1"
        assert launcher.free_port("cell-0") in json.loads((nodes / "1.json").read_text())["ports"]
        code = "import os, sys; print('token', os.environ['GYRE_TOKEN'][:3]); sys.exit(3)"
        launcher.start("cell-0", [sys.executable, "-c", code])
        with pytest.raises(ChildDied) as died:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                launcher.check()
                time.sleep(0.2)
        assert "cell-0 exited with code 3 on node 1 (127.0.0.1)" in str(died.value)
        assert "token ttt" in str(died.value)  # the agent gave it the run token from its file
    finally:
        launcher.close()
    assert agent.wait(60) == 0
    assert "gyre node 1: started cell-0" in said.read_text()


def test_node_launcher_names_the_key_when_no_agent_comes(tmp_path: Path) -> None:
    from gyre.system.nodeagent import NodeError, NodeLauncher

    with pytest.raises(NodeError, match=r"node 1's agent did not announce itself.*\[run\] node_agents"):
        NodeLauncher(tmp_path / "logs", tmp_path / "nodes", 1, "127.0.0.1", 0.5)
