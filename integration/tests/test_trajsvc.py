from __future__ import annotations

import pytest
from gyre.trajsvc import TrajectoryService
from gyre_traj.records import Score


def _svc(streaming: bool) -> TrajectoryService:
    # Never started: no core or scheduler is contacted; only the bookkeeping is exercised.
    return TrajectoryService(
        "tcp://127.0.0.1:1", "tcp://127.0.0.1:1", 2, streaming=streaming, token_budget=1024, j_max=5
    )


def _score(svc: TrajectoryService, step: int, eid: str, gid: str) -> None:
    svc._message("score", (step, Score(execution_id=eid, group_id=gid, value=0.5), 1))


@pytest.mark.parametrize("streaming", [False, True])
def test_ready_groups_follow_step_order(streaming: bool) -> None:
    svc = _svc(streaming)
    try:
        for k in range(2):
            svc._message(
                "batch", (k, {f"s{k}-q{q}": [f"s{k}-q{q}-e{j}" for j in range(2)] for q in range(2)})
            )
        # Step 1's batch completes while one group of step 0 is still running.
        for q in range(2):
            for j in range(2):
                _score(svc, 1, f"s1-q{q}-e{j}", f"s1-q{q}")
        _score(svc, 0, "s0-q0-e0", "s0-q0")
        _score(svc, 0, "s0-q0-e1", "s0-q0")
        # Trainable now: nothing without streaming (step 0 is incomplete and comes first); with streaming,
        # step 0's one complete group. Never step 1's batch.
        assert svc.ready_groups().ready == (1 if streaming else 0)
        _score(svc, 0, "s0-q1-e0", "s0-q1")
        _score(svc, 0, "s0-q1-e1", "s0-q1")
        assert svc.ready_groups().ready == 4  # both steps complete, in order
        svc.applied = 1  # step 0 applied: its groups leave
        rg = svc.ready_groups()
        assert rg.ready == 2 and rg.batch_groups == 2
    finally:
        svc.stop()
