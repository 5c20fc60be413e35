"""Open steps: a step opened, given its micro-batches in any number of adds over a real socket while the
core and satellite threads claim them as they arrive, and closed, gives the same weights as the whole
mini-batch submitted at once (bit for bit), whatever the arrival chunks and timing, whichever satellites
join and leave mid-step, and with one of them dying mid-micro-batch. The step's execution count enters
once, at close, so group-by-group packing trains the whole batch's normalization and advantages."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from gyre_base.testing import until
from gyre_train.checkpoint import TrainerState
from gyre_train.control import CoreClient, SubmitRefused
from gyre_train.core import Core, CoreConfig
from gyre_train.data import SMALL, synthetic_minibatch
from gyre_train.model import Layout, ModelConfig, build_model, micro_gradient
from gyre_train.normalize import execution_means
from gyre_train.protocol import Refusal
from gyre_train.satellite import Satellite, SatelliteConfig
from gyre_traj.loss import LossConfig
from gyre_traj.pack import PackConfig, PackItem, pack
from gyre_traj.records import Score
from gyre_traj.select import SelectionConfig, select
from gyre_traj.synth import SynthConfig, synth_execution
from gyre_traj.tree import ExecutionTree
from gyre_traj.weights import group_advantages
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

MC = ModelConfig()
L = synthetic_minibatch(6, seed=5)  # 12 micro-batches, in the order they arrive
SATS = ("sat-a", "sat-b")


def weights(core: Core) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in core.model.named_parameters()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(a[n], b[n], atol=atol, rtol=0.0, msg=n)


@dataclass
class Rig:
    core: Core
    initial: TrainerState
    whole: dict[str, torch.Tensor]
    """Weights after the whole of L submitted at once, trained by the core alone."""
    sats: dict[str, Satellite]

    def reset(self) -> None:
        for name in self.core.replicas():
            self.core.dismiss(name)
        self.core.set_computing(True)
        self.core.load_state_dict(copy.deepcopy(self.initial))


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    cfg = CoreConfig(token_budget=512, heartbeat_s=0.05, dead_after_s=0.6, idle_hold_s=0.02, inbox=2)
    core = Core(build_model(MC), MC, cfg)
    initial = copy.deepcopy(core.state_dict())
    feeder = CoreClient(core.address)
    sats = {name: Satellite(SatelliteConfig(core.address, name)) for name in SATS}
    threads = [threading.Thread(target=s.run, daemon=True) for s in sats.values()]
    for t in threads:
        t.start()
    try:
        feeder.submit(0, L)
        step = core.next_step(5.0)
        assert step is not None
        core.train_step(step)
        rig = Rig(core, initial, weights(core), sats)
        rig.reset()
        yield rig
    finally:
        feeder.close()
        core.close()
        for t in threads:
            t.join(timeout=30)
        for s in sats.values():
            s.close()


@st.composite
def feeds(draw: st.DrawFn) -> list[tuple[int, float, list[str]]]:
    """The arrival of L: chunks (end index, delay before the add, events at that point). Events: admit or
    dismiss a satellite, the core stopping or resuming its own computing, the doomed satellite joining."""
    cuts = sorted(draw(st.sets(st.integers(1, len(L) - 1), max_size=len(L) - 1)))
    ends = [*cuts, len(L)]
    events = st.lists(
        st.sampled_from(
            ["admit sat-a", "admit sat-b", "dismiss sat-a", "dismiss sat-b", "core off", "core on"]
        ),
        max_size=2,
    )
    plan = [(end, draw(st.sampled_from([0.0, 0.01, 0.08])), draw(events)) for end in ends]
    if draw(st.booleans()):  # one satellite joins at some add and dies in its first micro-batch
        plan[draw(st.integers(0, len(plan) - 1))][2].append("doomed")
    return plan


@settings(max_examples=16, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@example(plan=[(k + 1, 0.0, []) for k in range(len(L))])  # one micro-batch per add
@example(plan=[(len(L), 0.0, ["core off", "admit sat-a", "doomed"])])  # one add, core aggregates only
@given(plan=feeds())
def test_a_streamed_step_equals_the_whole_minibatch(
    rig: Rig, plan: list[tuple[int, float, list[str]]]
) -> None:
    core = rig.core
    rig.reset()
    seq = core.queue_position
    doomed: list[tuple[Satellite, threading.Thread]] = []
    feeder = CoreClient(core.address)
    errors: list[BaseException] = []

    def act(event: str) -> None:
        if event == "doomed":
            name = f"sat-doomed-{len(core.presumed_dead())}-{time.monotonic_ns()}"
            # It dies in its first micro-batch; if it never gets one, it leaves after a while idle.
            sat = Satellite(SatelliteConfig(core.address, name, vanish_after_claims=1, idle_exit_s=2.0))
            th = threading.Thread(target=sat.run, daemon=True)
            th.start()
            doomed.append((sat, th))
            core.admit(name)
        elif event.startswith("core"):
            core.set_computing(event == "core on")
        else:
            verb, name = event.split()
            (core.admit if verb == "admit" else core.dismiss)(name)

    def feed() -> None:
        try:
            feeder.open_step(seq)
            at = 0
            for end, delay, events in plan:
                time.sleep(delay)
                for e in events:
                    act(e)
                feeder.add(seq, L[at:end])
                at = end
            core.set_computing(True)  # someone must finish what is left
            feeder.close_step(seq, len(L))
        except BaseException as exc:
            errors.append(exc)

    th = threading.Thread(target=feed)
    th.start()
    try:
        step = core.next_step(30.0)
        assert step is not None and step.seq == seq
        report = core.train_step(step)
    finally:
        th.join(timeout=60)
        feeder.close()
        for sat, t in doomed:
            t.join(timeout=30)
            sat.close()
    assert not errors, errors
    assert report.microbatches == len(L) and sum(report.by_replica.values()) == len(L)
    assert report.version == 1 and report.executions == 1
    assert not any(n.startswith("sat-doomed") for n in report.by_replica)  # it never delivered
    if any(sat.claims for sat, _ in doomed):
        assert report.requeued >= 1  # its claim went back to the queue
    assert_same(weights(core), rig.whole)


def test_steps_stream_behind_a_step_in_progress_and_status_shows_them(rig: Rig) -> None:
    # mu = 2 with open steps: step k+1 is opened and given micro-batches while step k is still open and
    # training; its micro-batches wait (they need step k's weights) and train after k's update.
    core = rig.core
    rig.reset()
    A, B = L[:5], L[5:]
    burst = Core(build_model(MC), MC, CoreConfig(token_budget=512))
    try:
        burst.load_state_dict(copy.deepcopy(rig.initial))
        burst.train_burst([A, B])
        want = weights(burst)
    finally:
        burst.close()
    k = core.queue_position
    client = CoreClient(core.address)
    try:
        client.open_step(k)
        client.add(k, A[:2])
        client.open_step(k + 1)
        client.add(k + 1, B[:3])
        with pytest.raises(SubmitRefused) as why:
            client.open_step(k + 2)  # two steps wait already (inbox=2)
        assert why.value.refusal is Refusal.INBOX_FULL
        with pytest.raises(SubmitRefused) as why:
            client.close_step(k, 3)
        assert why.value.refusal is Refusal.COUNT_MISMATCH
        steps = client.status().steps
        assert [(s.seq, s.closed, s.training, s.microbatches, s.queued, s.done) for s in steps] == [
            (k, False, False, 2, 2, 0),
            (k + 1, False, False, 3, 3, 0),
        ]
        core.set_computing(False)  # so that the counts below stand still while we look
        first = core.next_step(5.0)
        assert first is not None
        done: list[object] = []
        runner = threading.Thread(target=lambda: done.append(core.train_step(first)))
        runner.start()
        until(lambda: client.status().steps[0].training, "the step training", 60.0)
        s0 = client.status().steps[0]
        assert (s0.training, s0.queued, s0.claimed, s0.done) == (True, 2, 0, 0)
        core.set_computing(True)
        client.add(k, A[2:])
        client.close_step(k, len(A))
        client.add(k + 1, B[3:])
        client.close_step(k + 1, len(B))
        with pytest.raises(SubmitRefused) as why:
            client.add(k, A[:1])
        assert why.value.refusal is Refusal.NOT_OPEN
        runner.join(timeout=120)
        second = core.next_step(5.0)
        assert second is not None and second.seq == k + 1
        r = core.train_step(second)
        assert r.version == 2 and r.queue_position == k + 2 and client.status().steps == ()
    finally:
        client.close()
    assert_same(weights(core), want)


def test_a_checkpoint_taken_mid_step_keeps_the_last_update(rig: Rig, tmp_path: Path) -> None:
    core = rig.core
    rig.reset()
    client = CoreClient(core.address)
    try:
        k = core.queue_position
        client.open_step(k)
        client.add(k, L[:4])
        core.save(tmp_path / "mid")
        client.add(k, L[4:])
        client.close_step(k, len(L))
        step = core.next_step(5.0)
        assert step is not None
        core.train_step(step)
    finally:
        client.close()
    # A new core resumed from it expects the open step again, from its start.
    other = Core(build_model(MC), MC, CoreConfig(token_budget=512))
    try:
        other.load(tmp_path / "mid")
        assert (other.version, other.queue_position) == (0, k)
        feeder = CoreClient(other.address)
        try:
            feeder.open_step(k)
            feeder.add(k, L)
            feeder.close_step(k, len(L))
        finally:
            feeder.close()
        step = other.next_step(5.0)
        assert step is not None
        other.train_step(step)
        assert_same(weights(other), rig.whole)
    finally:
        other.close()


def _groups(n_groups: int, size: int) -> tuple[list[list[PackItem]], list[PackItem]]:
    """Synthetic executions in groups, scored; items per group (group advantages computed per group)
    and for the whole batch (computed over every score at once)."""
    rng = np.random.default_rng(3)
    trees: dict[str, ExecutionTree] = {}
    scores = []
    for g in range(n_groups):
        for j in range(size):
            eid = f"g{g}-e{j}"
            t = ExecutionTree(eid)
            for c in synth_execution(SynthConfig(**{**SMALL.__dict__, "seed": 100 * g + j}), eid):
                t.add(c)
            trees[eid] = t
            scores.append(Score(execution_id=eid, group_id=f"g{g}", value=float(rng.uniform())))
    whole_adv, _ = group_advantages(scores)
    per_group: list[list[PackItem]] = []
    for g in range(n_groups):
        adv, _ = group_advantages([s for s in scores if s.group_id == f"g{g}"])
        assert adv == {e: a for e, a in whole_adv.items() if e.startswith(f"g{g}-")}  # bit for bit
        per_group.append(
            [PackItem(trees[e], select(trees[e], SelectionConfig(j_max=3)), a) for e, a in adv.items()]
        )
    whole = [it for items in per_group for it in items]
    return per_group, whole


def _token_weights(mbs: list, scale: float = 1.0) -> dict[tuple[str, int], float]:
    out = {}
    for b in mbs:
        owners = np.asarray(b.executions, dtype=object)[b.segment[b.target_pos]]
        for e, node, w in zip(owners, b.target_nodes.tolist(), b.weights.tolist(), strict=True):
            out[(str(e), int(node))] = w * scale
    return out


def test_the_execution_count_enters_once_at_close() -> None:
    # Three groups packed one by one as they become ready (each re-weighted to per-execution token means)
    # and streamed into an open step closed with the step's execution count, against the whole batch
    # packed at once by gyre-traj (weights 1 / (tokens x executions)).
    per_group, whole_items = _groups(3, 2)
    cfg = PackConfig(token_budget=512)
    whole = pack(whole_items, cfg)
    streamed, executions = [], 0
    for items in per_group:
        mbs, e = execution_means(pack(items, cfg))
        streamed += mbs
        executions += e
    assert executions == len(whole_items) == 6
    # The weights: each loss token's weight / E is the whole batch's (up to float32 rounding).
    w_whole, w_stream = _token_weights(whole), _token_weights(streamed, 1.0 / executions)
    assert w_whole.keys() == w_stream.keys()
    np.testing.assert_allclose([w_stream[k] for k in w_whole], list(w_whole.values()), rtol=1e-6)
    # The gradients: the in-order sum / E against the whole batch's sum (the same tokens, other cuts).
    model = build_model(MC)
    layout = Layout.of(model)
    loss = LossConfig()
    g_whole = sum(micro_gradient(model, layout, b, loss)[0].double() for b in whole)
    g_stream = sum(micro_gradient(model, layout, b, loss)[0].double() for b in streamed) / executions
    assert isinstance(g_whole, torch.Tensor) and isinstance(g_stream, torch.Tensor)
    scale = float(g_whole.abs().max())
    torch.testing.assert_close(g_stream, g_whole, rtol=1e-5, atol=1e-6 * scale)
    # And through a core: the streamed step (closed with E) trains what the whole batch trains.
    cores = [Core(build_model(MC), MC, CoreConfig(token_budget=512)) for _ in range(2)]
    try:
        ref = cores[0].train_step(whole)
        client = CoreClient(cores[1].address)
        try:
            client.open_step(0)
            at = 0
            for items in per_group:
                mbs, _ = execution_means(pack(items, cfg))
                client.add(0, mbs)
                at += len(mbs)
            client.close_step(0, at, executions)
        finally:
            client.close()
        step = cores[1].next_step(5.0)
        assert step is not None
        got = cores[1].train_step(step)
        assert got.executions == executions and ref.executions == 1
        assert got.loss == pytest.approx(ref.loss, rel=1e-5)
        assert got.grad_norm == pytest.approx(ref.grad_norm, rel=1e-5)
        # Rounding only: an update is lr = 1e-4 per weight; they differ by float32 ulps (1.2e-8 seen).
        assert_same(weights(cores[1]), weights(cores[0]), atol=1e-7)
    finally:
        for c in cores:
            c.close()
