"""The trajectory service's step book: when a group is ready, what the scheduler is told (untrained
ready groups from the core's `StepInfo`, the batch's completeness, whether the step has begun), with
streamed and whole steps; and groups packed one at a time give each execution to exactly one step.
Then the service itself against gyre-train's real core server and claim queue: steps handed over in
their turn, also while the core is landing an update."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from gyre.trajsvc.service import TrajectoryService
from gyre.trajsvc.stepbook import RecordsMissing, StepBook
from gyre_train.claimqueue import ClaimQueue
from gyre_train.protocol import PROTOCOL, StepInfo, Welcome
from gyre_train.server import ReplicaServer, ServerConfig
from gyre_traj.records import Call, Role, Score


def _book(streaming: bool) -> StepBook:
    return StepBook(2, streaming=streaming, token_budget=1024, j_max=5, record_wait_s=5.0)


def _register(book: StepBook, k: int) -> None:
    book.register(k, {f"s{k}-q{q}": [f"s{k}-q{q}-e{j}" for j in range(2)] for q in range(2)})


def _call(eid: str, out: list[int]) -> Call:
    # Token ids by role band: system 1000s, user 2000s, assistant output 5000s.
    return Call(
        execution_id=eid, call_id=f"{eid}-c{len(out)}-{out[0]}", agent_id="main", role=Role.MAIN,
        input_ids=np.array([1001, 2001, 2002]), output_ids=np.array(out),
        output_logprobs=np.full(len(out), -0.5), weight_version=0,
    )  # fmt: skip


def _finish_group(book: StepBook, k: int, q: int, now: float = 0.0, value: float = 0.5) -> None:
    for j in range(2):
        eid = f"s{k}-q{q}-e{j}"
        book.record(_call(eid, [5001 + j, 5002]))
        book.score(k, Score(execution_id=eid, group_id=f"s{k}-q{q}", value=value * j), 1, now)
    book.update_ready(book.steps[k], now)


def _training(seq: int, given: int, done: int, claimed: int = 0, closed: bool = False) -> StepInfo:
    return StepInfo(seq, closed, True, given, given - done - claimed, claimed, done)


@pytest.mark.parametrize("streaming", [False, True])
def test_ready_groups_follow_step_order(streaming: bool) -> None:
    book = _book(streaming)
    for k in range(2):
        _register(book, k)
    # Step 1's batch completes while one group of step 0 is still running.
    _finish_group(book, 1, 0)
    _finish_group(book, 1, 1)
    _finish_group(book, 0, 0)
    rg = book.report(0, 0, {})
    # Trainable now: nothing of whole steps (step 0 is incomplete and comes first); streamed, step 0's one
    # complete group. Never step 1's batch while step 0 is incomplete.
    assert (rg.ready, rg.batch_complete, rg.step_open) == (1 if streaming else 0, False, False)
    _finish_group(book, 0, 1)
    rg = book.report(0, 0, {})
    assert (rg.ready, rg.batch_complete) == (4, True)  # both steps complete, in order
    rg = book.report(1, 1, {})  # step 0 applied: its groups leave
    assert (rg.ready, rg.batch_groups, rg.batch_complete) == (2, 2, True)


@pytest.mark.parametrize("streaming", [False, True])
def test_steps_held_for_an_evaluation_count_no_ready_groups(streaming: bool) -> None:
    """An evaluation at version 1 holds step 1 (and so every later one) until it is done; it needs a
    rollout engine, so held groups must not keep the scheduler's cells training (a run whose rollout
    ran ahead of the hold waited forever with every cell training and nothing to train)."""
    book = _book(streaming)
    for k in range(3):
        _register(book, k)
        _finish_group(book, k, 0)
        _finish_group(book, k, 1)
    assert book.report(0, 0, {}).ready == 6
    assert book.report(0, 0, {}, hold=1).ready == 2  # step 0 trains up to the evaluation point
    assert book.report(1, 1, {}, hold=1).ready == 0  # at the point: nothing until the evaluation ends
    assert book.report(1, 1, {}, hold=2).ready == 2  # after it, the next step's groups


def test_streamed_groups_leave_the_count_as_they_are_trained() -> None:
    book = _book(True)
    _register(book, 0)
    _finish_group(book, 0, 0)
    sd = book.steps[0]
    sd.given["s0-q0"] = 1  # what the service does once it gave the group's micro-batch to the open step
    assert book.report(0, 0, {0: _training(0, 1, done=0)}).ready == 1
    rg = book.report(0, 0, {0: _training(0, 1, done=1)})
    # Trained, and the batch is still running: nothing left to claim, the step has begun, and the batch
    # is not complete (a Colocate pool would not train it; an elastic satellite goes back).
    assert (rg.ready, rg.step_open, rg.batch_complete) == (0, True, False)
    _finish_group(book, 0, 1)
    sd.given["s0-q1"] = 2
    rg = book.report(0, 0, {0: _training(0, 3, done=1, claimed=1)})
    assert (rg.ready, rg.step_open, rg.batch_complete) == (1, True, True)
    # All in, the update being applied: nothing trainable, and the batch stays complete until applied.
    rg = book.report(0, 0, {0: _training(0, 3, done=3, closed=True)})
    assert (rg.ready, rg.batch_complete) == (0, True)


def test_whole_steps_count_the_batch_until_trained() -> None:
    book = _book(False)
    _register(book, 0)
    _finish_group(book, 0, 0)
    _finish_group(book, 0, 1)
    sd = book.steps[0]
    assert book.report(0, 0, {}).ready == 2
    p = book.pack(sd, sd.groups)
    sd.tally.add(p, p.microbatches, len(p.items))
    sd.closed = True
    n = len(p.microbatches)
    assert book.report(0, 0, {0: StepInfo(0, True, False, n, n, 0, 0)}).ready == 2  # waiting its turn
    rg = book.report(0, 0, {0: StepInfo(0, True, True, n, 0, 0, n)})
    assert (rg.ready, rg.batch_complete, rg.step_open) == (0, True, True)


def test_a_group_is_ready_only_with_all_its_records() -> None:
    book = _book(True)
    _register(book, 0)
    sd = book.steps[0]
    for j in range(2):
        eid = f"s0-q0-e{j}"
        book.score(0, Score(execution_id=eid, group_id="s0-q0", value=0.0), 2, 10.0)
        book.record(_call(eid, [5001]))
    book.update_ready(sd, 11.0)
    assert sd.ready == []  # one of two calls each has arrived
    for j in range(2):
        book.record(_call(f"s0-q0-e{j}", [5002]))
    book.update_ready(sd, 12.0)
    assert sd.ready == ["s0-q0"]
    book.score(0, Score(execution_id="s0-q1-e0", group_id="s0-q1", value=0.0), 1, 10.0)
    book.score(0, Score(execution_id="s0-q1-e1", group_id="s0-q1", value=0.0), 1, 10.0)
    with pytest.raises(RecordsMissing, match=r"group s0-q1: records missing after 5.0s"):
        book.update_ready(sd, 15.5)


def test_groups_packed_one_by_one_train_each_execution_once() -> None:
    """Packing group by group (streaming) trains the same executions and loss tokens as packing the
    batch at once, and the step's close count is its executions with loss tokens."""
    from gyre_train.normalize import execution_means

    whole, streamed = _book(False), _book(True)
    for book in (whole, streamed):
        _register(book, 0)
        _finish_group(book, 0, 0)
        _finish_group(book, 0, 1)
    sd = whole.steps[0]
    p = whole.pack(sd, sd.groups)
    sd.tally.add(p, p.microbatches, len(p.items))
    sd = streamed.steps[0]
    for g in sd.ready:
        q = streamed.pack(sd, [g])
        mbs, n = execution_means(q.microbatches)
        sd.tally.add(q, mbs, n)
        assert all(np.allclose(b.weights, 0.5) for b in mbs)  # per-execution means: 2 loss tokens each
    a, b = whole.steps[0].tally.summary(0, []), streamed.steps[0].tally.summary(0, [])
    assert sorted(a["trained_executions"]) == sorted(b["trained_executions"])
    assert len(set(b["trained_executions"])) == len(b["trained_executions"]) == 4
    assert a["loss_tokens"] == b["loss_tokens"] == b["output_tokens_recorded"] == 8
    assert streamed.steps[0].tally.executions == 4


def test_an_execution_with_a_path_over_the_budget_is_set_aside_and_named() -> None:
    """A path longer than the micro-batch budget cannot be packed: its execution is set aside, untrained,
    and named in the step's summary with its length; the rest of its group trains (the service goes on)."""
    book = _book(True)
    _register(book, 0)
    long = [5001 + (i % 500) for i in range(1100)]  # 3 input + 1,100 output tokens > 1,024
    book.record(_call("s0-q0-e0", long))
    book.record(_call("s0-q0-e1", [5001, 5002]))
    for j in range(2):
        book.score(0, Score(execution_id=f"s0-q0-e{j}", group_id="s0-q0", value=0.5 * j), 1, 0.0)
    sd = book.steps[0]
    book.update_ready(sd, 0.0)
    p = book.pack(sd, ["s0-q0"])
    assert [it.tree.execution_id for it in p.items] == ["s0-q0-e1"]
    assert p.over_budget == {"s0-q0-e0": 1103}
    assert sum(b.num_loss_tokens for b in p.microbatches) == 2
    sd.tally.add(p, p.microbatches, len(p.items))
    summary = sd.tally.summary(0, sd.scores.values())
    assert summary["over_budget"] == {"s0-q0-e0": 1103}
    assert summary["trained_executions"] == ["s0-q0-e1"]


# ---- the trajectory service against a real core server and claim queue --------------------------------

NOWHERE = "tcp://127.0.0.1:1"  # no scheduler: the service never reports (report_s = inf)


@contextmanager
def _core_and_service(streaming: bool, position: int = 0) -> Iterator[tuple[ClaimQueue, TrajectoryService]]:
    """gyre-train's real claim queue behind its real server (loopback, no satellites), which this test
    drives as the core's training thread does; and a trajectory service feeding it."""
    queue = ClaimQueue(lambda mbs: None, inbox=4)
    queue.load_state_dict({"step": position, "version": position, "queue_position": position})
    welcome = Welcome(PROTOCOL, "", "shm", 1.0, "{}", "{}")
    server = ReplicaServer(ServerConfig(bind="tcp://127.0.0.1:0"), queue, welcome, lambda g: None)
    traj = TrajectoryService(
        server.address, NOWHERE, 1, streaming=streaming, token_budget=1024, j_max=5, report_s=float("inf")
    )
    try:
        traj.start()
        yield queue, traj
    finally:
        traj.stop()
        server.close()


def _until(what: str, ok: Callable[[], bool], traj: TrajectoryService, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert traj.failure() is None, f"the trajectory service failed: {traj.failure()}"
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.01)


@pytest.mark.parametrize("streaming", [True, False])
def test_a_step_handed_over_while_the_core_lands_an_update_is_accepted(streaming: bool) -> None:
    """The core's training thread takes the finished step off its queue (`finish`) before the update
    lands (`applied`/`skipped` advance the queue position). The next step the service opens or submits
    in between was refused as out of order ("step 2 out of order: the core expects 1"), which ended the
    service, and a run with no fault started a new attempt (2 runs in 16). The claim queue now counts the
    landing step, so the step is accepted at once."""
    with _core_and_service(streaming) as (queue, traj):
        for k in (0, 1):  # batches with no group: complete at once, handed over empty
            traj.register_batch(k, {})
        _until("steps 0 and 1 accepted, closed", lambda: [(i.seq, i.closed) for i in queue.steps()] == [(0, True), (1, True)], traj)  # fmt: skip
        step = queue.next_step(5.0)
        assert step is not None
        queue.begin(step)
        assert queue.wait_complete(5.0)
        queue.finish()  # step 0 leaves the queue; its update has not landed yet
        traj.register_batch(2, {})
        _until(
            "step 2 accepted while step 0 lands", lambda: [i.seq for i in queue.steps()] == [0, 1, 2], traj
        )
        queue.skipped()  # the update lands (an empty step: no update, its queue position taken)
        assert [i.seq for i in queue.steps()] == [1, 2]
        assert traj.failure() is None


def test_a_step_the_core_has_already_is_still_an_error() -> None:
    """A core ahead of the service (it holds steps the service
    has not handed over) refuses the service's first step as out of order, and the service fails naming
    it."""
    with _core_and_service(True, position=3) as (_, traj):
        traj.register_batch(0, {})
        deadline = time.monotonic() + 20.0
        while traj.failure() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "OpenStep of step 0 refused: step 0 out of order: the core expects 3" in str(traj.failure())
