"""Authentication of the integration's own listener and of `gyre run`'s token: the trajectory service's
records PULL refuses a bind beyond loopback without a token and, with one, hears only pushers holding it
(real ZeroMQ sockets, the service's own thread); `gyre run` puts one token in `$GYRE_TOKEN` for its
children and puts the environment back afterwards."""

from __future__ import annotations

import contextlib
import os
import time

import numpy as np
import pytest
import zmq
from gyre.config import runtoken
from gyre.trajsvc.service import TrajectoryService
from gyre_base import sockets
from gyre_base.token import MIN_TOKEN_CHARS, TOKEN_ENV, TokenRequiredError
from gyre_traj.io import Codec
from gyre_traj.records import Call, Role

TOKEN = "integration-test-token-0123456789"
WRONG = "integration-test-token-9876543210"
NOWHERE = "tcp://127.0.0.1:1"  # no core and no scheduler: the service never reports (report_s = inf)


pytestmark = pytest.mark.usefixtures("no_token")


def _service(bind: str, token: str) -> TrajectoryService:
    return TrajectoryService(
        NOWHERE,
        NOWHERE,
        1,
        streaming=True,
        token_budget=1024,
        j_max=5,
        report_s=float("inf"),
        bind=bind,
        token=token,
    )


def _call(n: int) -> bytes:
    call = Call(
        execution_id=f"e{n}", call_id=f"e{n}-c0", agent_id="main", role=Role.MAIN,
        input_ids=np.array([1001, 2001]), output_ids=np.array([5001, 5002]),
        output_logprobs=np.full(2, -0.5), weight_version=0,
    )  # fmt: skip
    return Codec().encode_msgpack(call)


def test_records_pull_binds_loopback_by_default() -> None:
    traj = TrajectoryService(NOWHERE, NOWHERE, 1, streaming=True, token_budget=1024, j_max=5)
    try:
        assert traj.address.startswith("tcp://127.0.0.1:")
    finally:
        traj.stop()


@pytest.mark.parametrize("bind", ["tcp://*:0", "tcp://0.0.0.0:0"])
def test_records_pull_beyond_loopback_without_a_token_is_refused(bind: str) -> None:
    with pytest.raises(TokenRequiredError, match=rf"refusing to bind .* {TOKEN_ENV}"):
        _service(bind, "")


def test_records_pull_hears_token_holders_only(beyond_loopback: str) -> None:
    host = beyond_loopback
    traj = _service(f"tcp://{host}:0", TOKEN)
    assert traj.address.startswith(f"tcp://{host}:")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    traj.start()
    try:
        pushers = {}
        for name, token in (("none", ""), ("wrong", WRONG), ("holder", TOKEN)):
            pushers[name] = sockets.connected(ctx, zmq.PUSH, traj.address, token)
        for n, name in enumerate(("none", "wrong")):
            with contextlib.suppress(zmq.Again):  # a refused handshake leaves no connection to queue on
                pushers[name].send(_call(n), zmq.NOBLOCK)
        time.sleep(1.0)  # long enough for both handshakes to be refused
        pushers["holder"].send(_call(2))
        deadline = time.monotonic() + 30.0
        while traj.records < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)
        assert traj.records == 1  # the holder's record, and nothing from the others
        assert traj.failure() is None
    finally:
        for s in pushers.values():
            s.close(0)
        ctx.term()
        traj.stop()


def test_gyre_run_puts_one_token_in_the_environment_and_takes_it_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    rt = runtoken.install()
    try:
        assert os.environ[TOKEN_ENV] == rt.token and rt.made
        assert len(rt.token) >= MIN_TOKEN_CHARS
        sockets.derive_keys(rt.token)  # a token CURVE accepts
    finally:
        rt.uninstall()
    assert TOKEN_ENV not in os.environ
    monkeypatch.setenv(TOKEN_ENV, TOKEN)  # a run spread over hosts: the token already set is the run's
    rt = runtoken.install()
    rt.uninstall()
    assert (rt.token, os.environ[TOKEN_ENV], rt.made) == (TOKEN, TOKEN, False)
