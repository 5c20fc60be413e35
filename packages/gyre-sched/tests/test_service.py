"""The service over real ZeroMQ sockets with real cell processes: a switch end to end, then a cell that
dies is marked failed after the timeout and the proxy is told to reroute its work."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import zmq
from gyre_base.testing import until
from gyre_sched.policy import WaterLevelConfig, WaterLevelPolicy
from gyre_sched.protocol import (
    Admission,
    Codec,
    EngineAdd,
    EngineDrain,
    EngineDrained,
    EngineRemove,
    GetState,
    Hello,
    Message,
    PeerKind,
    ReadyGroups,
    Reject,
    Role,
    State,
    WaterLevel,
    Welcome,
)
from gyre_sched.service import Scheduler, ServiceConfig

pytestmark = pytest.mark.slow


class Peer:
    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], addr: str, kind: PeerKind) -> None:
        self.codec = Codec()
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(addr)
        self.inbox: list[Message] = []
        self.send(Hello(kind))
        assert isinstance(self.recv(5.0), Welcome)

    def send(self, msg: Message) -> None:
        self.sock.send(self.codec.encode(msg))

    def recv(self, timeout: float) -> Message:
        if not self.sock.poll(int(timeout * 1000)):
            raise TimeoutError("no message")
        return self.codec.decode(self.sock.recv())

    def drain(self) -> None:
        while self.sock.poll(0):
            self.inbox.append(self.codec.decode(self.sock.recv()))


@pytest.fixture
def sched() -> Iterator[Scheduler]:
    cfg = ServiceConfig(bind="tcp://127.0.0.1:0", heartbeat_s=0.1, failure_timeout_s=1.0, drain_timeout_s=2.0)
    s = Scheduler(WaterLevelPolicy(WaterLevelConfig(hold_s=0.2, ready_fraction=0.25)), cfg)
    th = threading.Thread(target=s.serve_forever, daemon=True)
    th.start()
    yield s
    s.stop()
    th.join(5.0)
    assert not th.is_alive()


def spawn_cell(addr: str, cid: int, core: bool) -> subprocess.Popen[bytes]:
    args = [
        sys.executable,
        "-m",
        "gyre_sched.cli",
        "cell",
        "--connect",
        addr,
        "--id",
        str(cid),
        "--capacity",
        "10",
        "--endpoint",
        f"http://127.0.0.1:{30000 + cid}",
        "--switch-s",
        "0.1",
        "--peer-timeout-s",
        "10",
    ]
    return subprocess.Popen(args + (["--core"] if core else []), stderr=subprocess.DEVNULL)


def test_switch_and_failure(sched: Scheduler) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    procs = [spawn_cell(sched.endpoint, i, i == 0) for i in range(3)]
    try:
        proxy = Peer(ctx, sched.endpoint, PeerKind.PROXY)
        driver = Peer(ctx, sched.endpoint, PeerKind.DRIVER)
        traj = Peer(ctx, sched.endpoint, PeerKind.TRAJ)
        obs = Peer(ctx, sched.endpoint, PeerKind.OBSERVER)

        def state() -> State:
            obs.send(GetState())
            s = obs.recv(5.0)
            assert isinstance(s, State)
            return s

        def roles() -> dict[int, Role]:
            return {c.cell_id: c.role for c in state().cells}

        until(lambda: len(roles()) == 3, "three cells registered", 20.0)
        # Plenty of demand: nobody may leave rollout even with a full batch ready.
        driver.send(WaterLevel(25))
        traj.send(ReadyGroups(16, 16))
        time.sleep(0.6)
        assert set(roles().values()) == {Role.ROLLOUT}
        # The water level drops: the core drains, the proxy is asked to drain its engine.
        driver.send(WaterLevel(8))
        until(lambda: roles()[0] is Role.DRAINING, "core draining", 5.0)
        proxy.drain()
        assert any(isinstance(m, EngineDrain) and m.cell_id == 0 for m in proxy.inbox)
        proxy.send(EngineDrained(0))
        until(lambda: roles()[0] is Role.TRAINING, "core training", 5.0)
        proxy.drain()
        assert any(isinstance(m, EngineRemove) and m.cell_id == 0 and not m.failed for m in proxy.inbox)
        d = state().decisions[0]
        assert d.why.unfinished == 8 and d.why.capacity_after == 20 and d.why.ready_groups == 16
        # Kill a rollout cell: after the failure timeout it is FAILED and the proxy reroutes its work.
        procs[2].kill()
        procs[2].wait(5.0)
        until(lambda: roles()[2] is Role.FAILED, "cell 2 failed", 5.0)
        proxy.drain()
        assert any(isinstance(m, EngineRemove) and m.cell_id == 2 and m.failed for m in proxy.inbox)
        # Demand returns above the one cell left: the core comes back to rollout and is re-added.
        traj.send(ReadyGroups(0, 16))
        driver.send(WaterLevel(15))
        until(lambda: roles()[0] is Role.ROLLOUT, "core back in rollout", 5.0)
        proxy.drain()
        assert any(isinstance(m, EngineAdd) and m.cell_id == 0 for m in proxy.inbox)
        # Bad input is refused and changes nothing.
        driver.sock.send(b"\x00junk")
        assert isinstance(driver.recv(5.0), Reject)
        driver.send(WaterLevel(3, (1.0,), ()))
        assert isinstance(driver.recv(5.0), Reject)
        for s in (proxy, driver, traj, obs):
            s.sock.close(0)
    finally:
        for p in procs:
            p.kill()
            p.wait(5.0)
        ctx.term()


def test_colocate_satellite_drained_before_the_core() -> None:
    """A whole-pool switch: the proxy reports a satellite's engine drained before the core's. The satellite
    waits (it may not train before the core) and follows the core; the scheduler keeps running."""
    from gyre_sched.policy import ColocatePolicy

    cfg = ServiceConfig(
        bind="tcp://127.0.0.1:0", heartbeat_s=0.1, failure_timeout_s=5.0, drain_timeout_s=30.0,
        max_concurrent_switches=100,
    )  # fmt: skip
    s = Scheduler(ColocatePolicy(), cfg)
    th = threading.Thread(target=s.serve_forever, daemon=True)
    th.start()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    procs = [spawn_cell(s.endpoint, i, i == 0) for i in range(3)]
    try:
        proxy = Peer(ctx, s.endpoint, PeerKind.PROXY)
        traj = Peer(ctx, s.endpoint, PeerKind.TRAJ)
        obs = Peer(ctx, s.endpoint, PeerKind.OBSERVER)

        def roles() -> dict[int, Role]:
            obs.send(GetState())
            st = obs.recv(5.0)
            assert isinstance(st, State)
            return {c.cell_id: c.role for c in st.cells}

        until(lambda: len(roles()) == 3, "three cells registered", 20.0)
        traj.send(ReadyGroups(4, 4))  # the batch is complete: the whole pool drains
        until(lambda: set(roles().values()) == {Role.DRAINING}, "all cells draining", 5.0)
        proxy.send(EngineDrained(2))
        time.sleep(0.3)
        assert th.is_alive() and roles()[2] is Role.DRAINING  # waits for the core
        proxy.send(EngineDrained(0))
        proxy.send(EngineDrained(1))
        until(lambda: set(roles().values()) == {Role.TRAINING}, "the whole pool training", 10.0)
        assert th.is_alive()
    finally:
        for p in procs:
            p.kill()
            p.wait(5.0)
        s.stop()
        th.join(5.0)
        ctx.destroy(0)


@pytest.mark.parametrize(
    ("name", "admission"),
    [
        ("colocate", Admission.COHORT),
        ("colocate-runahead", Admission.ROLLING),
        ("elastic", Admission.ROLLING),
    ],
)
def test_welcome_tells_the_driver_when_batches_may_start(name: str, admission: Admission) -> None:
    """The live driver learns the policy's admission from Welcome, so `gyre run` and the simulator mean
    the same thing by each name (the driver applies `batches_to_start` with it)."""
    from gyre_sched.sim import make_policy
    from gyre_sched.workload import Workload

    s = Scheduler(make_policy(name, Workload()), ServiceConfig(bind="tcp://127.0.0.1:0"))
    th = threading.Thread(target=s.serve_forever, daemon=True)
    th.start()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(s.endpoint)
        codec = Codec()
        sock.send(codec.encode(Hello(PeerKind.DRIVER)))
        assert sock.poll(5000)
        w = codec.decode(sock.recv())
        assert isinstance(w, Welcome) and w.admission is admission
        sock.close(0)
    finally:
        s.stop()
        th.join(5.0)
        ctx.destroy(0)


def test_batch_complete_is_the_senders_when_given() -> None:
    """A trajectory service that counts only untrained groups says whether the batch is complete itself
    (Colocate trains until the step is applied while `ready` falls); an older one that omits it keeps
    the old reading, `ready >= batch_groups`."""
    from gyre_sched.policy import ColocatePolicy

    s = Scheduler(ColocatePolicy(), ServiceConfig(bind="tcp://127.0.0.1:0"))
    try:
        codec = Codec()
        s.receive([b"traj", codec.encode(Hello(PeerKind.TRAJ))])
        for msg, trainable, complete in [
            (ReadyGroups(4, 4), 4, True),
            (ReadyGroups(1, 4, step_open=True, batch_complete=True), 1, True),
            (ReadyGroups(0, 4, batch_complete=True), 0, True),
            (ReadyGroups(4, 4, batch_complete=False), 4, False),
            (ReadyGroups(3, 4), 3, False),
        ]:
            s.receive([b"traj", codec.encode(msg)])
            obs = s.observation()
            assert (obs.trainable, obs.batch_complete) == (trainable, complete), msg
    finally:
        s.close()


def test_the_drivers_held_batch_reaches_the_policy() -> None:
    """The driver says a batch waits for the next step (`WaterLevel.admission_held`); the service's
    observation carries it, so elastic's core trains a complete step at once with the water level high.
    A driver that omits it (an older sender) holds nothing back."""
    s = Scheduler(WaterLevelPolicy(WaterLevelConfig(hold_s=60.0)), ServiceConfig(bind="tcp://127.0.0.1:0"))
    try:
        codec = Codec()
        for ident, kind in ((b"driver", PeerKind.DRIVER), (b"traj", PeerKind.TRAJ)):
            s.receive([ident, codec.encode(Hello(kind))])
        s.receive([b"traj", codec.encode(ReadyGroups(4, 4, batch_complete=True))])
        s.receive([b"driver", codec.encode(WaterLevel(32))])
        assert not s.observation().admission_held
        s.receive([b"driver", codec.encode(WaterLevel(32, admission_held=True))])
        obs = s.observation()
        assert obs.admission_held and obs.step_unblocks and obs.unfinished == 32
    finally:
        s.close()
