"""A node lost under `gyre run --ray`: three Ray nodes on this machine (`raynodes.ray_nodes`), the
scheduler and the proxy on the head, cell 0 (the trainer core) on node n1 and cell 1 on node n2, and one
node killed at once (every process of its session, as when a host goes away) once the first step is
applied.

- n2 lost (a satellite cell's node): the run goes on without cell 1 and finishes on the nodes left,
  every record trained once and none lost, the loss and the time to the next step in the metrics.
- n1 lost (the core's node): the run stops with an error naming the core and the resource no live node
  has; `gyre run --resume --ray-resources` places the core on the head and finishes the run from the
  core's checkpoint, each step trained once.
- the core not pinned (a resource n1 and n2 both have; cell 1 on the head) and its node lost: the run
  goes on by itself in a new attempt, the core placed on the other node and continuing from its
  checkpoint, each step trained once, the loss and the time to the next step in the metrics.

Each takes a few minutes on 2 loaded cores (Ray starting three nodes, then the run)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from gyre.measure.runmetrics import read_steps
from gyre.system import policy
from gyre.system.resume import CHECKPOINT
from gyre.trajsvc import ledger

from .raynodes import RayNodes, ray_nodes

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "integration" / "examples" / "tiny.toml"
PLACED = {"sched": "head", "proxy": "head", "cell-0": "n1", "cell-1": "n2"}


def _resources(placed: dict[str, str]) -> str:
    return json.dumps({part: {f"gyre-{node}": 1} for part, node in placed.items()})


@pytest.fixture
def cluster() -> Iterator[RayNodes]:
    pytest.importorskip("ray")
    with ray_nodes({"head": 3, "n1": 1, "n2": 1}) as c:
        yield c


def _config(tmp_path: Path, out: Path, steps: int, core_lost: bool = False) -> Path:
    """tiny.toml for `steps` steps, out_dir `out`, the startup timeouts of a loaded machine. Where the core
    is lost (`core_lost`), each batch starts once the step before it is applied (max_ahead 0), so the loss
    lands between the first step's checkpoint and the next step: the core writes checkpoints in the
    background, and with batches ready it trains on while the first is written."""
    text = TINY.read_text().replace('out_dir = "gyre-run"', f'out_dir = "{out}"')
    text = text.replace("\nsteps = 2\n", f"\nsteps = {steps}\n", 1)
    if core_lost:
        assert "\nmax_ahead = 1" in text
        text = text.replace("\nmax_ahead = 1", "\nmax_ahead = 0", 1)
    text = text.replace("[run]\n", "[run]\nstartup_timeout_s = 900.0\ndeadline_s = 1800.0\n", 1)
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(text)
    return cfg


def _run_and_lose(
    c: RayNodes, argv: list[str], out: Path, node: str | Callable[[], str], log: Path
) -> tuple[int, float, float]:
    """`gyre run ARGV --ray` until its first step is applied and checkpointed, then node `node` (or the one
    `node()` names then) killed; (its exit code, when the node was killed, when it exited)."""
    env = {**c.env, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "gyre.cli", "run", *argv, "--ray", c.address]
    with open(log, "wb") as fh:
        p = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 1500
        while not read_steps(out) or (policy.checkpoint_version(out / CHECKPOINT) or 0) < 1:
            assert p.poll() is None, log.read_text(errors="replace")[-5000:]
            assert time.monotonic() < deadline, "no step applied within 1500 s"
            time.sleep(0.2)
        c.kill(node if isinstance(node, str) else node())
        killed = time.time()
        rc = p.wait(1500)
        return rc, killed, time.time()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def _on(out: Path) -> dict[str, str]:
    placed = json.loads((out / "logs" / "placement.json").read_text())
    return {x["name"]: x["node_id"] for x in placed["parts"]}


def _each_step_trained_once(out: Path, m: dict[str, Any], steps: int) -> list[dict[str, Any]]:
    """Every step applied once, every record of the log trained once, none lost (the ledger's account)."""
    assert m["steps_applied"] == steps and m["final_version"] == steps
    acc = m["accounting"]
    assert acc["applied_steps"] == steps and acc["records_trained"] > 0
    assert acc["records_lost"] == 0 and acc["records_trained_twice"] == 0, acc
    rows = ledger.read(out / ledger.LEDGER)
    assert [r["step"] for r in rows] == list(range(steps))
    trained = [e for r in rows for e in r["trained_executions"]]
    assert len(trained) == len(set(trained))
    assert [s["step"] for s in read_steps(out)] == list(range(1, steps + 1))  # the core applied each once
    return rows


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_a_satellite_node_lost_mid_run_the_run_finishes_without_it(tmp_path: Path, cluster: RayNodes) -> None:
    out = tmp_path / "run"
    argv = [str(_config(tmp_path, out, 4)), "--ray-resources", _resources(PLACED)]
    log = tmp_path / "gyre-run.log"
    rc, killed, ended = _run_and_lose(cluster, argv, out, "n2", log)
    said = log.read_text(errors="replace")
    assert rc == 0, said[-5000:]
    assert _on(out) == {part: cluster.nodes[f"gyre-{node}"] for part, node in PLACED.items()}
    m = json.loads((out / "metrics.json").read_text())
    _each_step_trained_once(out, m, 4)
    assert m["attempts"] == 1  # no new attempt: the run went on
    [lost] = m["survival"]["lost"]
    assert lost["part"] == "cell-1" and lost["node_id"] == cluster.nodes["gyre-n2"]
    assert lost["alive_at"] < lost["seen_at"] and lost["seen_at"] > killed  # its last answer, then the loss
    after = [s["t_end"] for s in read_steps(out) if s["t_end"] > killed]
    assert after  # steps applied after the node was gone
    assert lost["next_step_at"] in after and lost["recovery_s"] is not None
    rollout = [c for c in m["final_cells"].values() if c["role"] == "rollout"]
    assert rollout and all(c["engine_version"] == "4" for c in rollout)
    assert "cell-1 was lost" in said and "the run goes on without it" in said
    print(
        f"satellite node lost: the loss seen {lost['seen_at'] - killed:.1f} s after the kill, the next step "
        f"applied {after[0] - killed:.1f} s after it ({len(after)} steps after it); the run ended "
        f"{ended - killed:.1f} s after the kill; metrics recovery_s {lost['recovery_s']}"
    )


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_the_core_node_lost_the_run_stops_and_resumes_on_the_nodes_left(
    tmp_path: Path, cluster: RayNodes
) -> None:
    out = tmp_path / "run"
    argv = [str(_config(tmp_path, out, 3, core_lost=True)), "--ray-resources", _resources(PLACED)]
    log = tmp_path / "gyre-run.log"
    rc, killed, ended = _run_and_lose(cluster, argv, out, "n1", log)
    said = log.read_text(errors="replace")
    assert rc == 1, said[-5000:]
    assert "the trainer core" in said  # which part was lost, then why the run cannot be placed again
    assert "cell-0 asks for the Ray resource 'gyre-n1', which no live node of the cluster has" in said
    assert json.loads((out / "run.json").read_text())["state"] == "failed"
    kept = policy.checkpoint_version(out / CHECKPOINT)
    assert kept is not None and kept >= 1

    moved = {**PLACED, "cell-0": "head"}
    t0 = time.time()
    p = subprocess.run(
        [sys.executable, "-m", "gyre.cli", "run", "--resume", str(out), "--ray", cluster.address,
         "--ray-resources", _resources(moved)],
        capture_output=True, env={**cluster.env, "OMP_NUM_THREADS": "1"}, timeout=1500,
    )  # fmt: skip
    assert p.returncode == 0, (p.stdout + p.stderr).decode(errors="replace")[-5000:]
    assert _on(out) == {part: cluster.nodes[f"gyre-{node}"] for part, node in moved.items()}
    m = json.loads((out / "metrics.json").read_text())
    rows = _each_step_trained_once(out, m, 3)
    resumed = [r for r in rows if r["attempt"] > 0]
    assert resumed and min(r["step"] for r in resumed) == kept  # steps checkpointed before: not run again
    first = next(s for s in read_steps(out) if s["step"] == kept + 1)
    print(
        f"core node lost: gyre run stopped {ended - killed:.1f} s after the kill; the resumed run applied "
        f"its first step {first['t_end'] - t0:.1f} s after it started ({kept} steps kept)"
    )


@pytest.fixture
def two_for_the_core() -> Iterator[RayNodes]:
    pytest.importorskip("ray")
    with ray_nodes({"head": 3, "n1": 1, "n2": 1}, {"n1": {"gyre-core": 1}, "n2": {"gyre-core": 1}}) as c:
        yield c


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_the_core_node_lost_a_core_not_pinned_is_placed_again_and_the_run_goes_on(
    tmp_path: Path, two_for_the_core: RayNodes
) -> None:
    c = two_for_the_core
    out = tmp_path / "run"
    res = {part: {"gyre-head": 1} for part in ("sched", "proxy", "cell-1")} | {"cell-0": {"gyre-core": 1}}
    argv = [str(_config(tmp_path, out, 3, core_lost=True)), "--ray-resources", json.dumps(res)]
    node_name = {v: k.removeprefix("gyre-") for k, v in c.nodes.items()}
    first: dict[str, str] = {}

    def core_node() -> str:  # where Ray put the core: n1 or n2
        first.update(_on(out))
        return node_name[first["cell-0"]]

    log = tmp_path / "gyre-run.log"
    rc, killed, ended = _run_and_lose(c, argv, out, core_node, log)
    said = log.read_text(errors="replace")
    assert rc == 0, said[-5000:]
    lost_node = first["cell-0"]
    assert node_name[lost_node] in ("n1", "n2")
    other = c.nodes["gyre-n2" if node_name[lost_node] == "n1" else "gyre-n1"]
    assert _on(out) == {**first, "cell-0": other}  # the new attempt: the core on the node left
    assert "cell-0 (the trainer core) was lost on Ray" in said and "attempt 1 continues the run" in said
    m = json.loads((out / "metrics.json").read_text())
    rows = _each_step_trained_once(out, m, 3)
    assert m["attempts"] == 2
    resumed = [r for r in rows if r["attempt"] == 1]
    assert resumed and min(r["step"] for r in resumed) >= 1  # the checkpointed step not run again
    assert json.loads((out / "run.json").read_text())["state"] == "finished"
    [lost] = m["survival"]["lost"]
    assert lost["part"] == "cell-0" and lost["node_id"] == lost_node and lost["attempt"] == 0
    assert lost["alive_at"] < lost["seen_at"] and lost["seen_at"] > killed
    after = [s["t_end"] for s in read_steps(out) if s["t_end"] > lost["seen_at"]]
    assert after and lost["next_step_at"] == after[0]  # applied by the new attempt's core
    assert lost["seen_to_step_s"] == round(after[0] - lost["seen_at"], 3) > 0
    assert "the first step after cell-0's loss was applied" in said
    print(
        f"core node lost, core not pinned: the loss seen {lost['seen_at'] - killed:.1f} s after the kill "
        f"(detect_s {lost['detect_s']}), the next step applied {lost['seen_to_step_s']:.1f} s after the loss "
        f"was seen (recovery_s {lost['recovery_s']} from the last answer); {len(resumed)} steps in attempt "
        f"1; the run ended {ended - killed:.1f} s after the kill"
    )
