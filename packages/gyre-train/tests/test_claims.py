"""The claim queue and the ranks' gradient sums: gradients are summed in micro-batch order whoever
computes them, whatever order they arrive in, with any replicas dying and returning their claims; with
the bfloat16 wire dtype every gradient is rounded once, the same way wherever it was computed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gyre_train.claims import ClaimError, StepState
from gyre_train.data import synthetic_minibatch
from gyre_train.shardsum import ShardSum
from hypothesis import given, settings
from hypothesis import strategies as st


def _grads(n: int, numel: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    # Values of very different magnitudes, so that a different summation order would change the bits.
    return [
        (rng.standard_normal(numel) * 10.0 ** rng.integers(-6, 6, numel)).astype(np.float32) for _ in range(n)
    ]


def _reference(grads: list[np.ndarray]) -> np.ndarray:
    acc = grads[0].copy()
    for g in grads[1:]:
        acc += g
    return acc


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 12),
    at_start=st.integers(0, 12),
    seed=st.integers(0, 2**16),
    script=st.lists(
        st.tuples(st.sampled_from(["core", "s1", "s2"]), st.sampled_from(["claim", "finish", "die", "add"])),
        max_size=80,
    ),
)
def test_sum_is_order_independent(n: int, at_start: int, seed: int, script: list[tuple[str, str]]) -> None:
    # An open step that starts with some micro-batches and is given the rest one by one as it trains.
    grads = _grads(n, 33, seed)
    given_ = min(at_start, n)
    s = StepState(batch=0, n=given_, version=0, closed=given_ == n)
    total = ShardSum(33, torch.device("cpu"))
    held: dict[str, list[int]] = {"core": [], "s1": [], "s2": []}

    def deliver(who: str, i: int) -> None:
        if s.acceptable(who, i):
            assert total.add(0, i, grads[i])
            assert s.deliver(who, i)

    for who, what in script:
        if what == "add":
            if given_ < n:
                s.add(1)
                given_ += 1
                if given_ == n:
                    s.close()
        elif what == "claim":
            i = s.claim(who)
            if i is not None:
                held[who].append(i)
        elif what == "finish" and held[who]:
            i = held[who].pop(0)
            assert s.acceptable(who, i)
            deliver(who, i)
        elif what == "die":
            assert s.release(who) == len(held[who])
            held[who] = []
    # Whatever happened, the rest arrives and the core finishes it.
    if not s.closed:
        assert not s.complete
        s.add(n - given_)
        s.close()
    for who in held:
        for i in held[who]:
            deliver(who, i)
    while (i := s.claim("core")) is not None:
        deliver("core", i)
    assert s.complete
    got = total.total(0, n)
    assert got is not None
    np.testing.assert_array_equal(got.numpy(), _reference(grads))


def test_duplicate_and_foreign_gradients() -> None:
    g = _grads(3, 4, 0)
    s = StepState(batch=7, n=3, version=0)
    i = s.claim("s1")
    assert i == 0
    with pytest.raises(ClaimError, match="held by 's1'"):
        s.deliver("s2", 0)
    with pytest.raises(ClaimError, match="not in mini-batch 7"):
        s.acceptable("s1", 5)
    assert s.release("s1") == 1 and s.requeued == 1
    # s1 was presumed dead but was only slow: its gradient is still the gradient of micro-batch 0.
    assert s.deliver("s1", 0)
    assert not s.acceptable("core", 0) and not s.deliver("core", 0)  # a duplicate is ignored
    total = ShardSum(4, torch.device("cpu"))
    with pytest.raises(ValueError, match="shape"):
        total.add(7, 0, g[0][:2])
    with pytest.raises(ValueError, match="float64"):
        total.add(7, 0, g[0].astype(np.float64))
    assert total.add(7, 0, g[0]) and not total.add(7, 0, g[0])  # each index once
    for k in (2, 1):  # out of order: 2 waits for 1
        buf = g[k].copy()
        assert total.add(7, k, buf)
        buf[:] = np.nan  # the sender reuses its buffer as soon as add returns
    assert not total.add(6, 0, g[0])  # an older step's gradient changes nothing
    got = total.total(7, 3)
    assert got is not None
    np.testing.assert_array_equal(got.numpy(), _reference(g))
    assert not total.add(7, 3, g[0])  # a finished sum takes no more


def test_incomplete_sum_is_refused() -> None:
    total = ShardSum(1, torch.device("cpu"))
    total.add(0, 1, np.ones(1, np.float32))  # index 0 never came
    with pytest.raises(RuntimeError, match="0 of 2"):
        total.total(0, 2)
    empty = StepState(batch=0, n=0, version=0)  # a step with nothing to train
    assert empty.complete and empty.claim("core") is None
    assert ShardSum(1, torch.device("cpu")).total(0, 0) is None


def test_read_only_gradients_are_copied_not_wrapped() -> None:
    g = _grads(1, 5, 3)[0]
    ro = np.frombuffer(g.tobytes(), dtype=np.float32)  # read-only, as some receive buffers are
    assert not ro.flags.writeable
    total = ShardSum(5, torch.device("cpu"))
    assert total.add(0, 0, ro)
    got = total.total(0, 1)
    assert got is not None
    np.testing.assert_array_equal(got.numpy(), g)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 8), order_seed=st.integers(0, 2**16))
def test_bfloat16_wire_rounds_each_gradient_once_wherever_computed(
    seed: int, n: int, order_seed: int
) -> None:
    # Each micro-batch is either computed on the core (float32, rounded here) or arrives from a satellite
    # already in bf16 (rounded there), in any order: the sum is the same bits, and it is the in-order
    # float32 sum of the bf16-rounded gradients.
    grads = [torch.from_numpy(g) for g in _grads(n, 65, seed)]
    rng = np.random.default_rng(order_seed)
    total = ShardSum(65, torch.device("cpu"), torch.bfloat16)
    for i in rng.permutation(n).tolist():
        g = grads[i] if rng.random() < 0.5 else grads[i].to(torch.bfloat16)
        assert total.add(3, i, g)
    got = total.total(3, n)
    assert got is not None and got.dtype == torch.float32
    want = grads[0].to(torch.bfloat16).float()
    for g in grads[1:]:
        want += g.to(torch.bfloat16).float()
    assert torch.equal(got, want)


def test_the_claim_queue_is_safe_under_concurrent_replicas() -> None:
    # An open step fed in chunks by a feeder thread while four replica threads claim and deliver (one
    # "dies" now and then, returning its claims) and the training thread waits: the sum is still the
    # in-order one, bit for bit, and the step completes only once closed.
    import threading

    import torch
    from gyre_train.claimqueue import ClaimQueue, QueuedStep
    from gyre_train.protocol import Refusal

    mbs = synthetic_minibatch(1, seed=3)[:1] * 40  # the queue does not look inside micro-batches
    n = len(mbs)
    grads = _grads(n, 257, 9)
    q = ClaimQueue(check=lambda _: None, inbox=2)
    total = ShardSum(257, torch.device("cpu"))
    assert q.open(0) == (Refusal.NONE, "") and q.next_step(0.0) == QueuedStep(0)
    batch = q.begin(QueuedStep(0))

    def feeder() -> None:
        for lo in range(0, n, 7):
            assert q.add(0, mbs[lo : lo + 7])[0] is Refusal.NONE
        assert q.close(0, n + 1)[0] is Refusal.COUNT_MISMATCH
        assert q.close(0, n, executions=4)[0] is Refusal.NONE
        assert q.add(0, mbs[:1])[0] is Refusal.NOT_OPEN

    def replica(name: str, seed: int) -> None:
        rng = np.random.default_rng(seed)
        while not q.wait_complete(0.0):
            a = q.claim(name)
            if a is None:
                continue
            assert a.batch == batch and a.microbatch is mbs[a.index] and len(a.frames) == len(a.specs)
            if rng.random() < 0.2:
                q.release(name)  # died holding it: back to the front
                continue
            assert q.acceptable(name, a.batch, a.index, a.version)[0]
            assert total.add(a.batch, a.index, grads[a.index])
            q.deliver(name, a.batch, a.index, a.version)

    threads = [threading.Thread(target=feeder)]
    threads += [threading.Thread(target=replica, args=(f"r{k}", k)) for k in range(4)]
    for t in threads:
        t.start()
    while not q.wait_complete(0.05):
        pass
    for t in threads:
        t.join(timeout=30)
    res = q.finish()
    assert len(res.microbatches) == n and sorted(res.done) == list(range(n)) and res.executions == 4
    got = total.total(res.batch, n)
    assert got is not None
    np.testing.assert_array_equal((got / 4).numpy(), _reference(grads) / np.float32(4))
    assert q.applied(snapshot=7).queue_position == 1
    assert q.state_dict() == {"step": 1, "version": 1, "queue_position": 1}
    assert q.claim("r0") is None
    assert q.deliver("r0", batch, 0, 0) == (False, f"mini-batch {batch} is not in progress")


@pytest.mark.parametrize("lands", ["applied", "skipped"])
def test_the_next_step_is_accepted_while_the_finished_one_lands(lands: str) -> None:
    """`finish` hands the step to the training thread before its update lands (`applied`/`skipped` move
    the queue position). In between, the step still counts: the next step after the ones accepted is in
    its turn (it was refused as "step 2 out of order: the core expects 1", and a run with no fault
    started a new attempt), the landing step is closed to feeders and shows in `steps` as training with
    every gradient in, and a position cannot be loaded under it."""
    from gyre_train.claimqueue import ClaimQueue
    from gyre_train.protocol import Refusal

    q = ClaimQueue(check=lambda _: None, inbox=4)
    assert q.submit(0, [])[0] is Refusal.NONE
    assert q.submit(1, [])[0] is Refusal.NONE
    step = q.next_step(1.0)
    assert step is not None and step.seq == 0
    q.begin(step)
    assert q.wait_complete(1.0)
    q.finish()  # step 0 leaves the queue; its update has not landed
    assert [(i.seq, i.training, i.queued, i.claimed) for i in q.steps()] == [
        (0, True, 0, 0),
        (1, False, 0, 0),
    ]
    assert q.open(1)[0] is Refusal.OUT_OF_ORDER  # accepted already
    assert q.add(0, [])[0] is Refusal.NOT_OPEN and "closed" in q.add(0, [])[1]
    with pytest.raises(RuntimeError, match="no step accepted"):
        q.load_state_dict({"step": 0, "version": 0, "queue_position": 0})
    assert q.open(2) == (Refusal.NONE, "")
    getattr(q, lands)(*([7] if lands == "applied" else []))
    assert [i.seq for i in q.steps()] == [1, 2]
    assert q.position().queue_position == 1
    assert q.open(3) == (Refusal.NONE, "")
