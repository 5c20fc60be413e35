"""Fuzzing the trajectory service's records PULL over real CURVE sockets, from pushers that hold the run
token (what ZAP lets through: an authenticated peer gone wrong). Each case is a batch of messages of 1-3
frames: call records (some the execution's tree refuses: a repeated call id, an unknown or too short
delta parent), scores and call batches (records the PULL does not take), truncated records, real tags
over fields of any type and any msgpack extension, garbage, empty frames. After every case a good call
must be booked by the running service; at the end its thread is alive, it reports no failure, and every
message it refused is counted."""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
from gyre.trajsvc.service import TrajectoryService
from gyre_base import sockets
from gyre_traj.io import Codec
from gyre_traj.records import Call, CallBatch, Delta, EvalStatus, Role, Score, defer_input_sign_check
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

Ctx = zmq.Context[zmq.Socket[bytes]]
TOKEN = "trajsvc-fuzz-token-0123456789abcdef"
NOWHERE = "tcp://127.0.0.1:1"  # no core and no scheduler: the service never reports (report_s = inf)
CASES = 600


pytestmark = pytest.mark.usefixtures("no_token")


_codec = Codec()
_enc = msgspec.msgpack.Encoder()
_ints = st.one_of(st.integers(-3, 5), st.integers(-(2**63), 2**64 - 1))
_scalar = st.one_of(st.none(), st.booleans(), _ints, st.floats(), st.text(max_size=8), st.binary(max_size=8))
_ext = st.builds(msgspec.msgpack.Ext, st.integers(-3, 6), st.binary(max_size=24))
_value = st.recursive(
    st.one_of(_scalar, _ext),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
# Small pools, so that calls meet: the same execution, the same call id, a delta naming an earlier call.
_executions = st.sampled_from(["e0", "e1", "e2"])
_call_ids = st.builds("{}{}".format, st.sampled_from("abc"), st.integers(0, 300))
# Token ids by role band: user 2000s, assistant output 5000s.
_ids = st.lists(st.integers(2000, 2003), max_size=4).map(lambda xs: np.array(xs, np.int64))


@st.composite
def _call(draw: st.DrawFn) -> Call:
    out = draw(st.lists(st.integers(5000, 5003), max_size=3))
    kw: dict[str, Any] = {}
    if draw(st.booleans()):
        kw["input_ids"] = draw(_ids)
    else:
        kw["input_delta"] = Delta(draw(_call_ids), draw(st.integers(0, 12)), draw(_ids))
    cid = draw(_call_ids)
    if "input_delta" in kw and kw["input_delta"].parent == cid:
        cid += "x"
    return Call(
        execution_id=draw(_executions), call_id=cid, agent_id=draw(st.sampled_from(["main", "sub"])),
        role=draw(st.sampled_from(Role)), output_ids=np.array(out, np.int64),
        output_logprobs=np.full(len(out), -0.5), weight_version=draw(st.integers(0, 3)), **kw,
    )  # fmt: skip


_score = st.builds(
    Score,
    execution_id=_executions,
    group_id=st.just("q0"),
    value=st.floats(0.0, 1.0),
    status=st.just(EvalStatus.OK),
)
_batch = st.lists(_call(), min_size=1, max_size=3).map(
    lambda calls: CallBatch.of(
        list({c.call_id: c for c in calls if c.execution_id == calls[0].execution_id}.values())
    )
)
_record = st.one_of(_call(), _call(), _score, _batch)
_tags = st.sampled_from(["call", "score", "calls", "nothing"])
_fields = st.sampled_from(
    ["execution_id", "call_id", "agent_id", "role", "output_ids", "output_logprobs", "weight_version",
     "input_ids", "input_delta", "t_start", "v", "metadata", "call_ids", "tokens", "keeps", "value"]
)  # fmt: skip


@st.composite
def _frame(draw: st.DrawFn) -> bytes:
    """One frame: a record, a truncated one, a real tag over fields of any type, garbage, empty."""
    kind = draw(st.sampled_from(["record", "record", "truncated", "tagged", "garbage", "empty"]))
    if kind == "record":
        return _codec.encode_msgpack(draw(_record))
    if kind == "truncated":
        data = _codec.encode_msgpack(draw(_record))
        return data[: draw(st.integers(0, max(0, len(data) - 1)))]
    if kind == "tagged":
        fields = draw(st.dictionaries(_fields, _value, max_size=8))
        return _enc.encode({"kind": draw(_tags), **fields})
    if kind == "garbage":
        return draw(st.binary(min_size=1, max_size=40))
    return b""


_message = st.lists(_frame(), min_size=1, max_size=3)
"""One send: one frame (as the proxy sends) or several (refused as a whole)."""


@contextmanager
def _serving() -> Iterator[TrajectoryService]:
    traj = TrajectoryService(
        NOWHERE, NOWHERE, 1, streaming=True, token_budget=1024, j_max=5, report_s=float("inf"), token=TOKEN
    )
    traj.start()
    try:
        yield traj
    finally:
        traj.stop()


def _good(n: int, run: str) -> tuple[str, bytes]:
    eid = f"good-{run}-{n}"
    call = Call(
        execution_id=eid, call_id=f"{eid}-c0", agent_id="main", role=Role.MAIN,
        input_ids=np.array([1001, 2001]), output_ids=np.array([5001]),
        output_logprobs=np.full(1, -0.5), weight_version=0,
    )  # fmt: skip
    return eid, _codec.encode_msgpack(call)


@pytest.mark.fuzz
@pytest.mark.slow
def test_records_pull_fuzz_600_batches() -> None:
    """600 cases, each 1-6 messages from three token-holding pushers, then a good call from one of them:
    the service books it within 10 s (0 dead services, 0 failures), and counts what it dropped."""
    ctx: Ctx = zmq.Context()
    run = uuid.uuid4().hex[:8]  # good execution ids no fuzzed call can take first
    counter = itertools.count()
    ran = 0
    with _serving() as traj:
        pushers = []
        for _ in range(3):
            pushers.append(sockets.connected(ctx, zmq.PUSH, traj.address, TOKEN))

        @settings(
            max_examples=CASES,
            deadline=None,
            database=None,
            phases=[Phase.generate, Phase.shrink],
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(st.lists(st.tuples(st.integers(0, 2), _message), min_size=1, max_size=6), st.integers(0, 2))
        def case(batch: list[tuple[int, list[bytes]]], who: int) -> None:
            nonlocal ran
            ran += 1
            for i, frames in batch:
                pushers[i].send_multipart(frames)
            eid, good = _good(next(counter), run)
            pushers[who].send(good)
            deadline = time.monotonic() + 10.0
            while traj.recorded_calls(eid) < 1:
                assert traj.failure() is None, f"the service failed: {traj.failure()}"
                assert time.monotonic() < deadline, "the service stopped booking calls"
                time.sleep(0.005)
            assert traj.recorded_calls(eid) == 1

        case()
        assert traj.failure() is None
        dropped, records = traj.dropped, traj.records
        for s in pushers:
            s.close(0)
    ctx.term()
    assert ran >= CASES
    assert records >= CASES and dropped > 0
    print(f"records PULL fuzz: {ran} cases, {records} calls booked, {dropped} messages dropped")


def test_a_call_with_a_negative_token_id_is_dropped_and_its_tree_keeps_what_it_had() -> None:
    """The service decodes records with the sign scans left to the tree (which checks each token where
    it stores it): a call whose input or output holds a negative id is dropped and counted, the tree it
    would have extended stays as it was, and the same execution's next good call is booked."""
    ctx: Ctx = zmq.Context()
    eid = f"neg-{uuid.uuid4().hex[:8]}"

    def call(n: int, inp: list[int], out: list[int]) -> bytes:
        with defer_input_sign_check():  # the bytes a faulty sender would send (a Call refuses them)
            return _codec.encode_msgpack(Call(
                execution_id=eid, call_id=f"{eid}-c{n}", agent_id="main", role=Role.MAIN,
                input_ids=np.array(inp), output_ids=np.array(out),
                output_logprobs=np.full(len(out), -0.5), weight_version=0,
            ))  # fmt: skip

    with _serving() as traj:
        push = sockets.connected(ctx, zmq.PUSH, traj.address, TOKEN)
        push.send(call(0, [1001, 2001], [5001]))
        push.send(call(1, [1001, 2001, 5001, -3001], [5002]))  # a negative input id
        push.send(call(2, [1001, 2001, 5001, 3001], [5002, -5003]))  # a negative output id
        push.send(call(3, [1001, 2001, 5001, 3001], [5002]))
        deadline = time.monotonic() + 10.0
        while traj.recorded_calls(eid) < 2 or traj.dropped < 2:
            assert traj.failure() is None and time.monotonic() < deadline, (traj.dropped, traj.records)
            time.sleep(0.005)
        assert (traj.dropped, traj.recorded_calls(eid)) == (2, 2)
        push.close(0)
    ctx.term()


def test_a_call_sent_again_is_booked_once_and_other_records_are_dropped() -> None:
    """The PULL takes call records only, each once: a call sent again (as a proxy resends after a
    reconnect) or replayed from the proxy's log after it was booked is skipped, not counted as booked
    or dropped; a score or a call batch on the PULL is dropped and counted, and adds nothing."""
    ctx: Ctx = zmq.Context()
    eid = f"again-{uuid.uuid4().hex[:8]}"

    def call(n: int) -> Call:
        """The execution's n-th call: the first a full input, each next one extending the one before."""
        return Call(
            execution_id=eid, call_id=f"{eid}-c{n}", agent_id="main", role=Role.MAIN,
            input_ids=None if n else np.array([1001, 2001]),
            input_delta=Delta(f"{eid}-c{n - 1}", 2 * n + 1, np.array([3001])) if n else None,
            output_ids=np.array([5001 + n]), output_logprobs=np.full(1, -0.5), weight_version=0,
        )  # fmt: skip

    calls = [call(n) for n in range(4)]

    def booked(n: int, dropped: int) -> None:
        deadline = time.monotonic() + 10.0
        while traj.recorded_calls(eid) < n or traj.dropped < dropped:
            assert traj.failure() is None and time.monotonic() < deadline, (traj.dropped, traj.records)
            time.sleep(0.005)

    with _serving() as traj:
        push = sockets.connected(ctx, zmq.PUSH, traj.address, TOKEN)
        push.send(_codec.encode_msgpack(calls[0]))
        push.send(_codec.encode_msgpack(calls[0]))  # again
        push.send(_codec.encode_msgpack(Score(execution_id=eid, group_id="g", value=1.0)))
        push.send(_codec.encode_msgpack(CallBatch.of([calls[1]])))
        push.send(_codec.encode_msgpack(calls[1]))
        booked(2, 2)
        traj.replay(calls[:2])  # both booked already
        push.send(_codec.encode_msgpack(calls[1]))  # and once more
        push.send(_codec.encode_msgpack(calls[2]))
        booked(3, 2)
        push.send(_codec.encode_msgpack(calls[3]))  # (the replay was taken in a round before this one)
        booked(4, 2)
        assert (traj.dropped, traj.records, traj.recorded_calls(eid)) == (2, 4, 4)
        push.close(0)
    ctx.term()
