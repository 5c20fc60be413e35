"""Placement beyond the local launcher: `gyre run` through a Ray cluster (a real Ray head started here,
token authentication on, every gyre part placed through a placement group), a part's death named with
its log's tail as it is locally, and the SLURM way (a `gyre cell` started by someone else registers with
a running scheduler by address and token file).

Ray's own addresses are the machine's (Ray turns 127.0.0.1 into the node's address); gyre's parts all
land on this one node, so they bind loopback (launch.py). The Ray tests take a few minutes on 2 loaded
cores, most of it Ray starting its head and workers."""

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
from pathlib import Path
from typing import Any

import pytest
import zmq
from gyre.config.runconfig import ConfigError, config_from_dict
from gyre.system.attempt import parts_of
from gyre.system.launch import LOOPBACK, Host, LocalLauncher, PlacementError, bind_hosts, bundle_of
from gyre_base.ports import free_port
from gyre_base.testing import env_without_token
from gyre_base.token import TOKEN_ENV, new_token
from gyre_sched.client import dealer
from gyre_sched.protocol import Codec, GetState, Hello, PeerKind, Role, State

from .raynodes import ray_nodes
from .runcheck import assert_no_fault

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "integration" / "examples" / "tiny.toml"


def test_host_names_a_dead_process_with_its_log_tail(tmp_path: Path) -> None:
    """What a Ray actor reports for its part (the same class, run in-process): nothing while the process
    lives, then its name, exit code and the last lines of its log."""
    h = Host(str(tmp_path))
    h.start("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], {})
    h.start("boom", [sys.executable, "-c", "import sys; print('the reason it died'); sys.exit(3)"], {})
    deadline = time.monotonic() + 60
    why = None
    while why is None and time.monotonic() < deadline:
        why = h.failure()
        time.sleep(0.1)
    h.stop(5.0)
    assert why is not None
    assert "boom exited with code 3" in why and "the reason it died" in why


def test_local_launcher_binds_loopback(tmp_path: Path) -> None:
    launcher = LocalLauncher(tmp_path)
    assert launcher.host("cell-0") == "127.0.0.1" and launcher.local is launcher
    launcher.close()


def test_ray_resources_pin_each_part_and_span_nodes_binds_node_addresses() -> None:
    """The placement decision without a cluster: `[run] ray_resources` goes into each part's bundle
    (besides its CPU and the cell's GPU); parts all on the driver's node bind loopback, parts on several
    nodes bind their node's address and so does the driver (its trajectory service)."""
    cfg = config_from_dict(
        {
            "run": {
                "cells": 3,
                "ray_resources": {"sched": {"head": 1}, "cell-1": {"n1": 1}, "cell-2": {"n2": 0.5}},
            },
            "cell": {"device": "cuda"},
        }
    )
    parts = parts_of(cfg)
    assert [p.name for p in parts] == ["sched", "proxy", "cell-0", "cell-1", "cell-2"]
    assert [bundle_of(p) for p in parts] == [
        {"CPU": 1.0, "head": 1.0},
        {"CPU": 1.0},
        {"CPU": 1.0, "GPU": 1.0},
        {"CPU": 1.0, "GPU": 1.0, "n1": 1.0},
        {"CPU": 1.0, "GPU": 1.0, "n2": 0.5},
    ]
    names = ["sched", "proxy", "cell-0", "cell-1"]
    one = [("A", "10.0.0.1")] * 4
    assert bind_hosts(names, one, "A") == [LOOPBACK] * 4
    spread = [("A", "10.0.0.1"), ("A", "10.0.0.1"), ("B", "10.0.0.2"), ("C", "10.0.0.3")]
    assert bind_hosts(names, spread, "A") == ["10.0.0.1", LOOPBACK, "10.0.0.2", "10.0.0.3"]
    with pytest.raises(PlacementError, match="the proxy landed on node B"):
        bind_hosts(names, [("A", "10.0.0.1"), ("B", "10.0.0.2"), *spread[2:]], "A")


@pytest.mark.parametrize(
    ("table", "said"),
    [
        ({"cell-2": {"n": 1}}, "[run] ray_resources.cell-2: not a part of this run"),
        ({"driver": {"n": 1}}, "[run] ray_resources.driver: not a part of this run"),
        ({"sched": 1}, "[run] ray_resources.sched must be a table"),
        ({"proxy": {"CPU": 2}}, "[run] ray_resources.proxy.CPU: CPU and GPU are set by the run"),
        ({"cell-0": {"n": 0}}, "[run] ray_resources.cell-0.n must be a number > 0"),
        ({"cell-0": {"n": True}}, "[run] ray_resources.cell-0.n must be a number > 0"),
        ({"cell-0": {"n": "one"}}, "[run] ray_resources.cell-0.n must be a number > 0"),
    ],
)
def test_ray_resources_errors_name_the_key(table: dict[str, object], said: str) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict({"run": {"cells": 2, "ray_resources": table}})
    assert said in str(err.value)


# ---- SLURM: a cell started by the cluster's launcher -----------------------------------------------------


def _state(addr: str, token: str, timeout_s: float) -> State | None:
    """The scheduler's State as an observer holding `token` sees it, or None if it does not answer."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = dealer(ctx, addr, token)
    codec = Codec()
    try:
        sock.send(codec.encode(Hello(PeerKind.OBSERVER)))
        sock.send(codec.encode(GetState()))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if sock.poll(200):
                msg = codec.decode(sock.recv())
                if isinstance(msg, State):
                    return msg
        return None
    finally:
        sock.close(0)
        ctx.term()


def _stop(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_cell_registers_with_a_remote_scheduler_by_address_and_token_file(tmp_path: Path) -> None:
    """gyre-sched serves with a token file (CURVE); `gyre cell`, started as its own process as srun
    would start it (no $GYRE_TOKEN, only the token file and the scheduler's address), brings up its engine
    and trainer core and registers; an observer with the token sees it, one with another token sees
    nothing."""
    from gyre_engine.server.model_factory import create_model

    model = create_model(tmp_path / "model")
    token = new_token()
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    addr = f"tcp://127.0.0.1:{free_port()}"
    env = env_without_token()
    env["OMP_NUM_THREADS"] = "1"
    logs = tmp_path / "logs"
    logs.mkdir()
    with open(logs / "sched.log", "wb") as fh:
        sched = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gyre_sched.cli",
                "serve",
                "--bind",
                addr,
                "--token-file",
                str(token_file),
            ],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
        )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    args = {
        "sched": addr,
        "cell_id": 0,
        "is_core": True,
        "capacity": 4,
        "model_dir": str(model),
        "engine_port": free_port(),
        "run_dir": str(run_dir),
        "token_file": str(token_file),
        "startup_timeout_s": 600.0,
    }
    with open(logs / "cell.log", "wb") as fh:
        cell = subprocess.Popen(
            [sys.executable, "-m", "gyre.cli", "cell", "--args", json.dumps(args)],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        st = _state(addr, token, 120.0)  # the scheduler may still be starting
        assert st is not None, "the scheduler did not answer an observer holding the token"
        registered = None
        deadline = time.monotonic() + 600
        while registered is None and time.monotonic() < deadline:
            assert cell.poll() is None, (logs / "cell.log").read_text()[-3000:]
            st = _state(addr, token, 30.0)
            assert st is not None, "the scheduler stopped answering"
            registered = next((c for c in st.cells if c.cell_id == 0), None)
            time.sleep(1.0)
        assert registered is not None, (logs / "cell.log").read_text()[-3000:]
        assert registered.is_core and registered.role is Role.ROLLOUT and registered.capacity == 4
        core = json.loads((run_dir / "core.json").read_text())  # the trainer core is up, bound loopback
        assert core["core"].startswith("tcp://127.0.0.1:")
        assert _state(addr, new_token(), 5.0) is None  # another token: refused, nothing answers
    finally:
        _stop(cell)
        _stop(sched)
    assert cell.returncode == 0  # SIGTERM: the cell stops its engine and core and exits cleanly


# ---- Ray -------------------------------------------------------------------------------------------------


def _start_head(env: dict[str, str], port: int, temp: str, log: Path) -> subprocess.Popen[bytes] | None:
    """`ray start --head --block` in its own session; None if it gave up starting (Ray waits a fixed 30 s
    for its raylet to register, which a loaded machine can miss)."""
    ray_bin = Path(sys.executable).with_name("ray")
    argv = [str(ray_bin), "start", "--head", "--block", f"--port={port}", "--num-cpus=8", "--num-gpus=0"]
    argv += ["--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}"]
    with open(log, "wb") as fh:
        head = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + 300
    while "Ray runtime started" not in log.read_text(errors="replace"):
        if head.poll() is not None:
            _stop_head(head)
            return None
        assert time.monotonic() < deadline, "the Ray head did not start within 300 s"
        time.sleep(0.5)
    return head


def _stop_head(head: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(head.pid, signal.SIGTERM)  # the head's own session: raylet, GCS and workers
    try:
        head.wait(60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)
        head.wait(10)


@pytest.fixture(scope="module")
def ray_head() -> Iterator[tuple[str, dict[str, str]]]:
    """A Ray head on this machine (its own session and temp dir, token authentication with a fresh token,
    8 logical CPUs, no GPU); yields its address and the environment a client needs. Three tries: under
    heavy load Ray's own fixed startup wait can run out."""
    pytest.importorskip("ray")
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": new_token(),
        "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    }
    env.pop(TOKEN_ENV, None)
    logs = []
    for _ in range(3):
        temp = tempfile.mkdtemp(prefix="gyre-ray-", dir="/tmp")  # short: Ray's socket paths have a limit
        port = free_port()
        logs.append(Path(temp) / "head.log")
        head = _start_head(env, port, temp, logs[-1])
        if head is not None:
            break
    else:
        raise AssertionError("the Ray head did not start: " + logs[-1].read_text(errors="replace")[-3000:])
    try:
        yield f"127.0.0.1:{port}", env
    finally:
        _stop_head(head)


def _run_through_ray(cfg: Path, address: str, env: dict[str, str], out: Path, label: str) -> dict[str, Any]:
    """`gyre run CONFIG --ray ADDRESS` to its end (it must succeed); its metrics.json."""
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "gyre.cli", "run", str(cfg), "--ray", address],
        capture_output=True,
        env=env,
        timeout=2400,
    )
    said = p.stdout.decode(errors="replace") + p.stderr.decode(errors="replace")
    assert p.returncode == 0, said[-5000:]
    print(f"gyre run {label}: {time.monotonic() - t0:.1f} s wall")
    metrics: dict[str, Any] = json.loads((out / "metrics.json").read_text())
    return metrics


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(2400)  # about 2 minutes on a quiet machine; over 10 on this one under load
def test_gyre_run_tiny_through_ray(tmp_path: Path, ray_head: tuple[str, dict[str, str]]) -> None:
    """integration/examples/tiny.toml as it is (out_dir and the startup timeouts of a loaded machine
    aside), through `gyre run --ray ADDRESS`: scheduler, proxy and both cells placed by Ray, the run token
    on every part, two steps applied and reached the rollout engine."""
    address, env = ray_head
    out = tmp_path / "run"
    text = TINY.read_text().replace('out_dir = "gyre-run"', f'out_dir = "{out}"')
    text = text.replace("[run]\n", "[run]\nstartup_timeout_s = 900.0\ndeadline_s = 1800.0\n", 1)
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(text)
    m = _run_through_ray(cfg, address, env, out, "through Ray")
    assert m["steps_applied"] == 2 and m["final_version"] == 2
    assert_no_fault(m, out)
    rollout = [c for c in m["final_cells"].values() if c["role"] == "rollout"]
    assert rollout and all(c["engine_version"] == "2" for c in rollout)
    placed = json.loads((out / "logs" / "placement.json").read_text())
    assert placed["ray_address"] == address and placed["one_node"] is True
    assert [x["name"] for x in placed["parts"]] == ["sched", "proxy", "cell-0", "cell-1"]
    assert {x["node_id"] for x in placed["parts"]} == {placed["driver_node_id"]}
    assert all(x["bind"] == "127.0.0.1" for x in placed["parts"])
    assert placed["run_token"] == "new"  # none was given: the launcher made one for every part


_DEAD_PART = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from gyre.system.launch import Part, RayLauncher
    from gyre.procs.group import ChildDied

    launcher = RayLauncher(sys.argv[1], Path(sys.argv[2]), [Part("boom")], 300.0)
    try:
        launcher.start("boom", [sys.executable, "-c", "import sys; print('the reason it died'); sys.exit(3)"])
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                launcher.check()
            except ChildDied as exc:
                print("CHILD-DIED:", exc)
                break
            time.sleep(0.2)
    finally:
        launcher.close()
    """
)


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_part_that_dies_on_ray_is_named_with_its_log_tail(
    tmp_path: Path, ray_head: tuple[str, dict[str, str]]
) -> None:
    address, env = ray_head
    p = subprocess.run(
        [sys.executable, "-c", _DEAD_PART, address, str(tmp_path / "logs")],
        capture_output=True,
        env=env,
        timeout=600,
    )
    said = p.stdout.decode(errors="replace")
    assert p.returncode == 0, said + p.stderr.decode(errors="replace")[-3000:]
    assert "CHILD-DIED: boom exited with code 3" in said and "the reason it died" in said


@pytest.fixture(scope="module")
def three_nodes() -> Iterator[tuple[str, dict[str, str], dict[str, str]]]:
    """A Ray cluster of three nodes on this machine (`raynodes.ray_nodes`): the head with 3 CPUs and
    `gyre-head`, two nodes of 1 CPU with `gyre-n1` and `gyre-n2`. Yields the address, the environment a
    client needs and a map resource -> node id (as Ray itself lists its nodes)."""
    pytest.importorskip("ray")
    with ray_nodes({"head": 3, "n1": 1, "n2": 1}) as c:
        yield c.address, c.env, c.nodes


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_gyre_run_tiny_on_three_ray_nodes(
    tmp_path: Path, three_nodes: tuple[str, dict[str, str], dict[str, str]]
) -> None:
    """integration/examples/tiny.toml for 3 steps through `gyre run --ray` on a three-node cluster, each
    part pinned by `[run] ray_resources`: the scheduler and the proxy on the head, cell 0 (the core) on
    one node and cell 1 on the other. Each part's actor reports the node it runs on (placement.json), the
    parts bind their node's address (the placement spans nodes), and the 3 steps are applied and on the
    rollout engine."""
    address, env, nodes = three_nodes
    out = tmp_path / "run"
    text = TINY.read_text().replace('out_dir = "gyre-run"', f'out_dir = "{out}"')
    text = text.replace("\nsteps = 2\n", "\nsteps = 3\n", 1)
    text = text.replace(
        "[run]\n",
        "[run]\nstartup_timeout_s = 900.0\ndeadline_s = 1800.0\n"
        "ray_resources = { sched = { gyre-head = 1 }, proxy = { gyre-head = 1 }, "
        '"cell-0" = { gyre-n1 = 1 }, "cell-1" = { gyre-n2 = 1 } }\n',
        1,
    )
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(text)
    env = {**env, "OMP_NUM_THREADS": "1"}
    m = _run_through_ray(cfg, address, env, out, "on three Ray nodes")
    assert m["steps_applied"] == 3 and m["final_version"] == 3
    rollout = [c for c in m["final_cells"].values() if c["role"] == "rollout"]
    assert rollout and all(c["engine_version"] == "3" for c in rollout)
    placed = json.loads((out / "logs" / "placement.json").read_text())
    on = {x["name"]: x["node_id"] for x in placed["parts"]}
    assert on == {
        "sched": nodes["gyre-head"],
        "proxy": nodes["gyre-head"],
        "cell-0": nodes["gyre-n1"],
        "cell-1": nodes["gyre-n2"],
    }
    assert placed["one_node"] is False
    assert placed["driver"]["node_id"] == nodes["gyre-head"]  # `gyre run` attaches to the head here
    binds = {x["name"]: x["bind"] for x in placed["parts"]}
    assert binds.pop("proxy") == "127.0.0.1"  # on the driver's node, for its harnesses
    assert all(
        binds[x["name"]] == x["node_address"] != "127.0.0.1" for x in placed["parts"] if x["name"] in binds
    )
    assert {x["name"]: x["resources"] for x in placed["parts"]}["cell-1"] == {"CPU": 1.0, "gyre-n2": 1.0}


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ("{not json", "--ray-resources is not JSON"),
        ('{"cell-5": {"n": 1}}', "[run] ray_resources.cell-5: not a part of this run"),
        ('{"cell-0": {"n": 0}}', "[run] ray_resources.cell-0.n must be a number > 0"),
    ],
)
def test_ray_resources_from_the_command_line_are_checked_as_the_config_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], given: str, said: str
) -> None:
    """`gyre run --ray-resources JSON` (the placement of a resumed run after a node was lost): refused
    before anything is claimed or started, naming the key."""
    from gyre.cli import main

    out = tmp_path / "run"
    assert main(["run", str(TINY), "--out", str(out), "--ray-resources", given]) == 2
    assert said in capsys.readouterr().err
    assert not out.exists()
