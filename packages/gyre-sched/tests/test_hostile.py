"""Hostile frames against the real service and the real cell process, over real ZeroMQ sockets.

Any frame sequence from any local peer (several frames, truncated or garbage bytes, tagged arrays of the
wrong types, impossible values, messages out of turn, another protocol version) is refused or dropped and
logged; the service keeps serving a good peer after every batch, and a process whose loop dies anyway
exits non-zero with the traceback.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import msgspec
import pytest
import zmq
from gyre_sched.policy import WaterLevelConfig, WaterLevelPolicy
from gyre_sched.protocol import (
    PROTOCOL_VERSION,
    Codec,
    EngineDrained,
    GetState,
    Heartbeat,
    Hello,
    Message,
    PeerKind,
    ReadyGroups,
    Reject,
    Role,
    State,
    SwitchCommand,
    SwitchDone,
    WaterLevel,
    Welcome,
)
from gyre_sched.service import Scheduler, ServiceConfig
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .frames import frames

Ctx = zmq.Context[zmq.Socket[bytes]]


@contextmanager
def serving(hold_s: float = 0.0, proxy_wait_s: float = 30.0) -> Iterator[Scheduler]:
    """A scheduler on a free loopback port, served by its own thread; checks the thread outlived the test."""
    cfg = ServiceConfig(
        bind="tcp://127.0.0.1:0", heartbeat_s=0.2, failure_timeout_s=5.0, drain_timeout_s=proxy_wait_s
    )
    s = Scheduler(WaterLevelPolicy(WaterLevelConfig(hold_s=hold_s, ready_fraction=0.25)), cfg)
    th = threading.Thread(target=s.serve_forever, daemon=True)
    th.start()
    try:
        yield s
        assert th.is_alive(), "the service loop died"
    finally:
        s.stop()
        th.join(5.0)


def dealer(ctx: Ctx, addr: str) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    return sock


def ask(sock: zmq.Socket[bytes], msg: Message, timeout_s: float = 5.0) -> Message:
    """Send `msg` and return the next reply (skipping nothing)."""
    codec = Codec()
    sock.send(codec.encode(msg))
    if not sock.poll(int(timeout_s * 1000)):
        raise TimeoutError(f"no reply to {type(msg).__name__} in {timeout_s}s")
    return codec.decode(sock.recv())


def reply_to(sock: zmq.Socket[bytes], frames: list[bytes], timeout_s: float = 5.0) -> Message:
    sock.send_multipart(frames)
    if not sock.poll(int(timeout_s * 1000)):
        raise TimeoutError("no reply")
    return Codec().decode(sock.recv())


def good_peer_answered(obs: zmq.Socket[bytes]) -> None:
    assert isinstance(ask(obs, GetState()), State)


# ---- fixed cases, each of which ended (or corrupted) the old service --------------------------------------


def test_multi_frame_message_is_refused_and_the_service_carries_on() -> None:
    ctx: Ctx = zmq.Context()
    with serving() as s:
        obs, bad = dealer(ctx, s.endpoint), dealer(ctx, s.endpoint)
        assert isinstance(ask(obs, Hello(PeerKind.OBSERVER)), Welcome)
        enc = Codec().encode(GetState())
        for frames in ([enc, enc], [b"", enc], [enc, b"x", b"y"]):
            r = reply_to(bad, frames)
            assert isinstance(r, Reject) and "one frame per message" in r.reason
            good_peer_answered(obs)
    ctx.destroy(0)


def test_impossible_values_and_other_versions_are_refused() -> None:
    ctx: Ctx = zmq.Context()
    with serving() as s:
        obs, drv = dealer(ctx, s.endpoint), dealer(ctx, s.endpoint)
        assert isinstance(ask(obs, Hello(PeerKind.OBSERVER)), Welcome)
        r = ask(drv, Hello(PeerKind.DRIVER, protocol=PROTOCOL_VERSION + 1))
        assert isinstance(r, Reject) and f"protocol {PROTOCOL_VERSION + 1} unsupported" in r.reason
        assert isinstance(ask(drv, Hello(PeerKind.DRIVER)), Welcome)
        for msg in (
            WaterLevel(-1),
            WaterLevel(3, (float("nan"),), (3,)),
            WaterLevel(3, (1.0,), (-3,)),
            WaterLevel(1, (), (), (float("inf"),), (False,)),
            ReadyGroups(2, 0),
            ReadyGroups(-1, 4),
            ReadyGroups(1, 4, mean_staleness=float("nan")),
            Hello(PeerKind.CELL, cell_id=-2, capacity=3),
            Hello(PeerKind.CELL, cell_id=5, capacity=-3),
            Heartbeat(0, Role.ROLLOUT, float("nan")),
        ):
            assert isinstance(ask(drv, msg), Reject), msg
        assert ask(obs, GetState()) == State((), 0, 0, ())  # nothing above changed anything
    ctx.destroy(0)


def test_switch_done_before_the_switch_command_is_refused() -> None:
    """A cell that reports TRAINING while still draining (no SwitchCommand sent yet) used to reach an
    illegal DRAINING -> TRAINING transition, whose InvariantError ended the loop."""
    ctx: Ctx = zmq.Context()
    with serving(hold_s=0.0, proxy_wait_s=30.0) as s:
        obs, cell, proxy, drv, traj = (dealer(ctx, s.endpoint) for _ in range(5))
        assert isinstance(ask(obs, Hello(PeerKind.OBSERVER)), Welcome)
        assert isinstance(ask(proxy, Hello(PeerKind.PROXY)), Welcome)  # drains wait for the proxy
        r = ask(cell, Hello(PeerKind.CELL, cell_id=0, is_core=True, capacity=8, endpoint="http://e0"))
        assert isinstance(r, Welcome)
        for peer, kind in ((drv, PeerKind.DRIVER), (traj, PeerKind.TRAJ)):
            assert isinstance(ask(peer, Hello(kind)), Welcome)
        drv.send(Codec().encode(WaterLevel(0)))
        traj.send(Codec().encode(ReadyGroups(8, 8)))

        def roles() -> dict[int, Role]:
            st_ = ask(obs, GetState())
            assert isinstance(st_, State)
            return {c.cell_id: c.role for c in st_.cells}

        for _ in range(100):
            if roles()[0] is Role.DRAINING:
                break
            threading.Event().wait(0.05)
        assert roles()[0] is Role.DRAINING
        r = ask(cell, SwitchDone(0, Role.TRAINING, 1))
        assert isinstance(r, Reject) and "no switch 1 commanded" in r.reason
        assert roles()[0] is Role.DRAINING
        proxy.send(Codec().encode(EngineDrained(0)))  # the real protocol still works afterwards
        for _ in range(100):
            while cell.poll(0):
                m = Codec().decode(cell.recv())
                if isinstance(m, SwitchCommand):
                    cell.send(Codec().encode(SwitchDone(0, m.role, m.decision)))
            if roles()[0] is Role.TRAINING:
                break
            threading.Event().wait(0.05)
        assert roles()[0] is Role.TRAINING
    ctx.destroy(0)


def test_one_peer_is_one_cell() -> None:
    """A peer registered as cell 0 that says Hello as cell 1 (or as the proxy) is refused: cell 0's
    commands and liveness are tied to that peer, which the old service silently re-labelled."""
    ctx: Ctx = zmq.Context()
    with serving() as s:
        obs, cell, other = dealer(ctx, s.endpoint), dealer(ctx, s.endpoint), dealer(ctx, s.endpoint)
        assert isinstance(ask(obs, Hello(PeerKind.OBSERVER)), Welcome)
        assert isinstance(ask(cell, Hello(PeerKind.CELL, cell_id=0, is_core=True, capacity=8)), Welcome)
        for again in (Hello(PeerKind.CELL, cell_id=1, capacity=8), Hello(PeerKind.PROXY)):
            r = ask(cell, again)
            assert isinstance(r, Reject) and "this peer is cell 0" in r.reason
        assert isinstance(ask(other, Hello(PeerKind.CELL, cell_id=1, capacity=8)), Welcome)
        st_ = ask(obs, GetState())
        assert isinstance(st_, State) and [c.cell_id for c in st_.cells] == [0, 1]
    ctx.destroy(0)


# ---- any frame sequence ------------------------------------------------------------------------------------

_send = st.tuples(st.integers(0, 2), frames)
_batches = st.lists(st.lists(_send, min_size=1, max_size=8), min_size=1, max_size=3)


@pytest.mark.slow
def test_any_frame_sequence_leaves_the_service_serving() -> None:
    ctx: Ctx = zmq.Context()

    @settings(
        max_examples=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(_batches)
    def run(batches: list[list[tuple[int, list[bytes]]]]) -> None:
        with serving() as s:
            obs = dealer(ctx, s.endpoint)
            assert isinstance(ask(obs, Hello(PeerKind.OBSERVER)), Welcome)
            socks = [dealer(ctx, s.endpoint) for _ in range(3)]
            for batch in batches:
                for who, frames in batch:
                    socks[who].send_multipart(frames)
                good_peer_answered(obs)
            for sock in (*socks, obs):
                sock.close(0)

    run()
    ctx.destroy(0)


# ---- the cell process ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_cell_process_drops_hostile_frames_and_keeps_its_protocol() -> None:
    """A real `gyre-sched cell` process against a ROUTER that sends it garbage, several frames, wrong
    types and a switch to a non-target role, before and after its Welcome: it still switches when told."""
    ctx: Ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    args = ["--connect", f"tcp://127.0.0.1:{port}", "--id", "0", "--core", "--switch-s", "0.05"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "gyre_sched.cli", "cell", *args, "--peer-timeout-s", "20"],
        stderr=subprocess.PIPE,
    )
    codec = Codec()

    def recv(timeout_s: float = 10.0) -> tuple[bytes, Message]:
        assert router.poll(int(timeout_s * 1000)), "the cell went quiet"
        ident, data = router.recv_multipart()
        return ident, codec.decode(data)

    hostile = [
        [b"\xc1garbage"],
        [b""],
        [codec.encode(GetState()), codec.encode(GetState())],
        [msgspec.msgpack.encode(["switch", "one", None])],
        [codec.encode(WaterLevel(-1))],
        [codec.encode(GetState())],
    ]
    try:
        ident, hello = recv()
        assert isinstance(hello, Hello) and hello.cell_id == 0
        for frames in hostile:
            router.send_multipart([ident, *frames])
        router.send_multipart([ident, codec.encode(Welcome(heartbeat_s=0.2))])
        for frames in hostile:
            router.send_multipart([ident, *frames])
        router.send_multipart([ident, codec.encode(SwitchCommand(1, Role.DRAINING, True))])
        router.send_multipart([ident, codec.encode(SwitchCommand(2, Role.TRAINING, True))])
        for _ in range(200):
            _, m = recv()
            if isinstance(m, SwitchDone):
                assert (m.decision, m.role) == (2, Role.TRAINING)
                break
        else:
            raise AssertionError("no SwitchDone")
        assert proc.poll() is None
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=10)
        router.close(0)
        ctx.destroy(0)
    assert b"dropped a bad frame" in err and b"dropped a message of 2 frames" in err


def test_cell_refuses_a_scheduler_of_another_version() -> None:
    ctx: Ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gyre_sched.cli", "cell", "--connect", f"tcp://127.0.0.1:{port}", "--id", "1"],
        stderr=subprocess.PIPE,
    )
    try:
        assert router.poll(20_000)
        ident, _ = router.recv_multipart()
        router.send_multipart([ident, Codec().encode(Welcome(protocol=PROTOCOL_VERSION + 1))])
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
        router.close(0)
        ctx.destroy(0)
    assert proc.returncode == 2
    assert f"scheduler speaks protocol {PROTOCOL_VERSION + 1}".encode() in err


# ---- a loop that dies anyway ---------------------------------------------------------------------------------


def test_service_process_exits_loudly_when_its_loop_dies() -> None:
    """`serve_main` (what `gyre-sched serve` runs) with a policy that raises, standing in for any bug the
    frames above did not reach: the process exits 1 with the traceback instead of lingering."""
    script = textwrap.dedent(
        """
        import logging, sys
        from gyre_sched.service import Scheduler, ServiceConfig, serve_main

        class Broken:
            name = "broken"
            def decide(self, obs, cells):
                raise RuntimeError("policy bug")

        logging.basicConfig(level=logging.INFO, stream=sys.stderr)
        sys.exit(serve_main(Scheduler(Broken(), ServiceConfig(bind="tcp://127.0.0.1:0"))))
        """
    )
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60, check=False)
    err = p.stderr.decode()
    assert p.returncode == 1
    assert "the scheduler loop died" in err and "Traceback" in err and "RuntimeError: policy bug" in err
