"""Fuzzing gyre-sched's two ZeroMQ decoders, the service's and the cell process's, over real CURVE
sockets with peers that hold the run token (an authenticated peer gone wrong is the worst case left once
ZAP keeps everyone else out). Each case is a batch of sends of 1-3 frames: valid messages, truncated
ones, real tags over values of the wrong types, garbage, empty frames. After every batch the fuzzed side
must answer a good request; at the end its loop or process must be alive (0 dead services)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import zmq
from gyre_base.sockets import bind, make_socket
from gyre_base.testing import fuzz_settings
from gyre_base.token import TOKEN_ENV
from gyre_sched.client import dealer
from gyre_sched.policy import WaterLevelConfig, WaterLevelPolicy
from gyre_sched.protocol import (
    Codec,
    GetState,
    Hello,
    PeerKind,
    Role,
    State,
    SwitchCommand,
    SwitchDone,
    Welcome,
)
from gyre_sched.service import Scheduler, ServiceConfig
from hypothesis import given
from hypothesis import strategies as st

from .frames import frames

Ctx = zmq.Context[zmq.Socket[bytes]]
TOKEN = "sched-fuzz-token-0123456789abcdef"
SERVICE_CASES = 1000
CELL_CASES = 500


@contextmanager
def serving() -> Iterator[Scheduler]:
    cfg = ServiceConfig(bind="tcp://127.0.0.1:0", token=TOKEN, heartbeat_s=0.2, failure_timeout_s=2.0)
    s = Scheduler(WaterLevelPolicy(WaterLevelConfig(hold_s=0.0, ready_fraction=0.25)), cfg)
    th = threading.Thread(target=s.serve_forever, daemon=True)
    th.start()
    try:
        yield s
        assert th.is_alive(), "the service loop died"
    finally:
        s.stop()
        th.join(5.0)


def _drain(sock: zmq.Socket[bytes]) -> None:
    while sock.poll(0):
        sock.recv_multipart()


@pytest.mark.fuzz
@pytest.mark.slow
def test_service_decoder_fuzz_1000_batches() -> None:
    """1,000 cases, each 1-8 sends from three token-holding peers that may register as anything; after
    each the service answers an observer's GetState. The cell table, decisions and switch bookkeeping
    carry over from case to case, so later cases hit whatever state earlier ones left."""
    ctx: Ctx = zmq.Context()
    codec = Codec()
    ran = 0
    with serving() as s:
        obs = dealer(ctx, s.endpoint, TOKEN)
        obs.send(codec.encode(Hello(PeerKind.OBSERVER)))
        assert obs.poll(5000) and isinstance(codec.decode(obs.recv()), Welcome)
        peers = [dealer(ctx, s.endpoint, TOKEN) for _ in range(3)]

        @fuzz_settings(SERVICE_CASES)
        @given(st.lists(st.tuples(st.integers(0, 2), frames), min_size=1, max_size=8))
        def case(batch: list[tuple[int, list[bytes]]]) -> None:
            nonlocal ran
            ran += 1
            for who, fr in batch:
                peers[who].send_multipart(fr)
            obs.send(codec.encode(GetState()))
            assert obs.poll(10_000), "the service stopped answering"
            assert isinstance(codec.decode(obs.recv()), State)
            for p in peers:
                _drain(p)

        case()
    ctx.destroy(0)
    assert ran >= SERVICE_CASES


@pytest.mark.fuzz
@pytest.mark.slow
def test_cell_process_decoder_fuzz_500_batches(tmp_path: Path) -> None:
    """500 cases against a real `gyre-sched cell` process (token from GYRE_TOKEN): each 1-6 sends from
    its scheduler, then a SwitchCommand it must answer with the matching SwitchDone."""
    ctx: Ctx = zmq.Context()
    codec = Codec()
    router = make_socket(ctx, zmq.ROUTER)
    endpoint = bind(router, "tcp://127.0.0.1:0", TOKEN)
    log = (tmp_path / "cell.log").open("w")
    argv = [
        "cell",
        "--connect",
        endpoint,
        "--id",
        "0",
        "--core",
        "--switch-s",
        "0",
        "--peer-timeout-s",
        "120",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "gyre_sched.cli", *argv], stderr=log, env={**os.environ, TOKEN_ENV: TOKEN}
    )
    decisions = itertools.count(100)
    ran = 0
    try:
        assert router.poll(30_000), "the cell never said Hello"
        ident, data = router.recv_multipart()
        assert isinstance(codec.decode(data), Hello)
        router.send_multipart([ident, codec.encode(Welcome(heartbeat_s=1.0))])

        @fuzz_settings(CELL_CASES)
        @given(st.lists(frames, min_size=1, max_size=6))
        def case(batch: list[list[bytes]]) -> None:
            nonlocal ran
            ran += 1
            for fr in batch:
                router.send_multipart([ident, *fr])
            d = next(decisions)
            role = Role.TRAINING if d % 2 else Role.ROLLOUT
            router.send_multipart([ident, codec.encode(SwitchCommand(d, role, True))])
            while True:  # skip heartbeats and answers to the batch's own SwitchCommands
                assert router.poll(10_000), "the cell stopped answering"
                _, data = router.recv_multipart()
                m = codec.decode(data)
                if isinstance(m, SwitchDone) and m.decision == d:
                    assert m.role is role
                    break

        case()
        assert proc.poll() is None, "the cell process died"
    finally:
        proc.kill()
        proc.wait(timeout=30)
        log.close()
        router.close(0)
        ctx.destroy(0)
    assert ran >= CELL_CASES
    assert "dropped a bad frame" in (tmp_path / "cell.log").read_text()
