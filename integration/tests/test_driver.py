"""The rollout driver starts batches as gyre-sched's policy admits them: it reads the admission from the
`Welcome` its water-level socket receives (a real scheduler over ZeroMQ) and applies `batches_to_start`.
ROLLING (elastic) starts batch k once k - applied <= max_ahead; COHORT (the report's Colocate) starts a
cohort together and the next only once every started batch is trained; nothing starts without a
Welcome. The water level it reports says whether a batch waits for the next step. No engine or proxy:
every execution fails at its first call, which is all the driver needs."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from gyre.config.runconfig import config_from_dict
from gyre.rollout.driver import Driver, NoWelcome
from gyre.trajsvc.service import TrajectoryService
from gyre_sched.service import Scheduler, ServiceConfig
from gyre_sched.sim import make_policy
from gyre_sched.workload import Workload


@pytest.fixture(params=["elastic", "colocate"])
def sched(request: pytest.FixtureRequest) -> Iterator[Scheduler]:
    s = Scheduler(make_policy(request.param, Workload()), ServiceConfig(bind="tcp://127.0.0.1:0"))
    th = threading.Thread(target=s.serve_forever, daemon=True)
    th.start()
    yield s
    s.stop()
    th.join(5.0)


def _driver(sched_address: str, startup_timeout_s: float = 30.0) -> tuple[Driver, TrajectoryService]:
    cfg = config_from_dict(
        {
            "run": {"steps": 4, "startup_timeout_s": startup_timeout_s},
            "batch": {"queries": 1, "group_size": 2},
            "agent": {"turns": 1, "timeout_s": 5.0},
            "driver": {"max_ahead": 1, "report_s": 0.05},
        }
    )
    # Never started: it only collects what the driver registers; the test sets `applied` itself.
    traj = TrajectoryService(sched_address, sched_address, 1, streaming=True, token_budget=1024, j_max=5)
    return Driver(cfg, "http://127.0.0.1:9", sched_address, traj, np.full((4, 1, 2), 0.01)), traj


def _started(d: Driver) -> set[int]:
    with d.lock:
        return set(d.state.batches_started)


def _wait(cond: Callable[[], bool], what: str) -> None:
    end = time.monotonic() + 20.0
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_batches_start_as_the_policy_admits(sched: Scheduler) -> None:
    d, traj = _driver(sched.endpoint)
    cohort = sched.policy.name == "colocate"
    try:
        d.start()
        _wait(lambda: _started(d) == {0, 1}, "the first two batches")
        _wait(lambda: len(d.outcomes()) == 4, "their executions to end (no proxy: each fails)")
        time.sleep(0.3)
        assert d.admission is sched.policy.admission
        assert _started(d) == {0, 1}  # max_ahead = 1: batch 2 waits for step 0 either way
        assert d.water_level().admission_held  # and the scheduler hears that it waits
        traj.applied = 1
        if cohort:  # batch 1 is not trained yet: no new cohort
            time.sleep(0.5)
            assert _started(d) == {0, 1}
            traj.applied = 2
            _wait(lambda: _started(d) == {0, 1, 2, 3}, "the second cohort, whole")
        else:
            _wait(lambda: _started(d) == {0, 1, 2}, "batch 2")
            time.sleep(0.3)
            assert _started(d) == {0, 1, 2}
            traj.applied = 2
            _wait(lambda: _started(d) == {0, 1, 2, 3}, "batch 3")
        started = d.state.batches_started
        if cohort:  # a cohort starts together
            assert abs(started[3] - started[2]) < 0.5
        _wait(d.done.is_set, "the driver to finish")
        assert d.error is None
        assert not d.water_level().admission_held  # every batch started: nothing waits
    finally:
        d.stop()
        traj.stop()


@contextlib.contextmanager
def _driver_that_gave_up() -> Iterator[Driver]:
    """A driver pointed at a ROUTER that never answers, once it has given up (startup_timeout_s 0.5);
    stopped on the way out."""
    import zmq

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    d, traj = _driver(f"tcp://127.0.0.1:{port}", startup_timeout_s=0.5)
    try:
        d.start()
        _wait(d.done.is_set, "the driver to give up")
        yield d
    finally:
        d.stop()
        traj.stop()
        silent.close(0)
        ctx.term()


def test_a_scheduler_refusing_the_handshake_does_not_keep_the_driver_from_stopping(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # With the run token set, the driver's report socket speaks CURVE; a ROUTER without it never
    # completes the handshake. The report thread used to block in send() for good, so stop() waited out
    # its 30 s join limit and left the thread behind.
    from gyre_base.token import TOKEN_ENV

    monkeypatch.setenv(TOKEN_ENV, "t" * 32)
    with _driver_that_gave_up() as d:
        assert isinstance(d.error, NoWelcome)
    assert "water-level" not in {t.name for t in threading.enumerate()}, "the report thread is still up"


def test_no_welcome_is_an_error() -> None:
    # A ROUTER that never answers: the driver gives up after startup_timeout_s, starting nothing.
    with _driver_that_gave_up() as d:
        assert isinstance(d.error, NoWelcome) and "no Welcome" in str(d.error)
        assert _started(d) == set()


def test_stopping_ends_the_executions_in_flight(sched: Scheduler) -> None:
    """Executions whose calls never get an answer (a listener that accepts and stays silent) end when the
    driver is stopped, as at their timeout, rather than keeping stop() waiting for its threads' join
    limit (30 s) with the driver thread left running."""
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    port = silent.getsockname()[1]
    cfg = config_from_dict(
        {
            "run": {"steps": 2},
            "batch": {"queries": 1, "group_size": 2},
            "agent": {"turns": 1, "timeout_s": 120.0, "request_timeout_s": 120.0},
            "driver": {"max_ahead": 1, "report_s": 0.05},
        }
    )
    traj = TrajectoryService(sched.endpoint, sched.endpoint, 1, streaming=True, token_budget=1024, j_max=5)
    d = Driver(cfg, f"http://127.0.0.1:{port}", sched.endpoint, traj, np.full((2, 1, 2), 0.01))
    try:
        d.start()
        _wait(lambda: len(d.state.running) == 4, "four executions waiting on their first call")
        d.stop()
        assert d.done.is_set(), "the driver thread is still running"
        assert "driver" not in {t.name for t in threading.enumerate()}
        assert d.error is None
    finally:
        d.stop()
        traj.stop()
        silent.close()
