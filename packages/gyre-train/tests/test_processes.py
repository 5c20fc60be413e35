"""Core and satellites as separate processes on real sockets: the weights after a mu=2 burst are the
single-replica weights whether 0, 1 or 2 satellites join at random points, and a satellite killed in
the middle of a mini-batch has its claim re-queued with the same result. Snapshots and gradients go over
Mooncake TCP between the processes (the code path RDMA clusters run). The satellite processes are
started once for the whole module and reused across every scenario: joining rebuilds nothing."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from gyre_base.testing import until
from gyre_train.core import Core, CoreConfig
from gyre_train.data import synthetic_minibatch
from gyre_train.model import ModelConfig, build_model

pytestmark = [pytest.mark.slow, pytest.mark.mooncake]  # snapshots and gradients over Mooncake TCP

MC = ModelConfig()
A = synthetic_minibatch(4, seed=11)
B = synthetic_minibatch(4, seed=12)
SATS = ("sat-0", "sat-1")
CRASHER = "sat-crash"


class Cluster:
    def __init__(self, tmp: Path) -> None:
        self.core = Core(
            build_model(MC),
            MC,
            CoreConfig(
                token_budget=512, heartbeat_s=0.25, dead_after_s=5.0, idle_hold_s=0.5, transport="mooncake"
            ),
        )
        self.init = self.core.save(tmp / "init")
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        for name in (*SATS, CRASHER):
            cmd = [
                sys.executable,
                "-m",
                "gyre_train.cli",
                "satellite",
                "--core",
                self.core.address,
                "--name",
                name,
            ]
            if name == CRASHER:
                cmd += ["--crash-after-claims", "1"]
            with open(tmp / f"{name}.log", "wb") as log:
                self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        until(lambda: len(self.core.replicas()) == 3, "three satellites to say hello", 180.0)

    def reset(self) -> None:
        for name in self.core.replicas():
            self.core.dismiss(name)
        self.core.load(self.init)

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.core.model.named_parameters()}

    def close(self) -> None:
        self.core.close()
        for p in self.procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        from gyre_xfer.shm import sweep_orphans

        sweep_orphans()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def reference(cluster: Cluster) -> dict[str, torch.Tensor]:
    cluster.reset()
    reports = cluster.core.train_burst([A, B])
    assert all(set(r.by_replica) == {"core"} for r in reports)
    return cluster.weights()


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for n in a:
        torch.testing.assert_close(a[n], b[n], atol=1e-7, rtol=1e-6, msg=n)


@pytest.mark.parametrize("n_sats", [0, 1, 2])
def test_satellites_joining_at_random_points_change_nothing(
    cluster: Cluster, reference: dict[str, torch.Tensor], n_sats: int
) -> None:
    rng = random.Random(1000 + n_sats)
    core = cluster.core
    cluster.reset()
    # Each satellite joins at a random step of the burst, after a random number of the core's own
    # micro-batches (0 = before the step starts); the core waits at its next micro-batch boundary until
    # the satellite has claimed work (or none is left), so the join really happens mid-step.
    joins = {name: (rng.randrange(2), rng.randrange(len(A) - 2)) for name in SATS[:n_sats]}
    step = [0]

    def joined(name: str) -> bool:
        return core.replicas().get(name, {}).get("claims", 0) > 0 or core.pending() == 0

    def progress(k: int) -> None:
        for name, (s, at) in joins.items():
            if s != step[0]:
                continue
            if at == k:
                core.admit(name)
            if at <= k:
                until(lambda n=name: joined(n), f"{name} to claim", 120.0)

    reports = []
    for i, mb in enumerate((A, B)):
        for name, (s, at) in joins.items():
            if s == i and at == 0:
                core.admit(name)
        reports.append(core.train_step(mb, on_progress=progress))
        step[0] += 1
    computed = {name: sum(r.by_replica.get(name, 0) for r in reports) for name in SATS[:n_sats]}
    if n_sats:
        assert sum(computed.values()) > 0, computed
    assert [r.version for r in reports] == [1, 2]
    assert_close(cluster.weights(), reference)


def test_satellite_killed_mid_micro_batch_of_a_streamed_step_is_requeued(
    cluster: Cluster, reference: dict[str, torch.Tensor]
) -> None:
    # Step 0 is opened and given its micro-batches two at a time over the socket while it trains; a
    # satellite process admitted from the start is SIGKILLed holding its first micro-batch, another
    # joins mid-step. The claim is re-queued and the weights are those of the whole mini-batch.
    from gyre_train.control import CoreClient

    core = cluster.core
    cluster.reset()
    core.admit(CRASHER)
    core.set_computing(False)  # the crasher gets the first micro-batch
    seq = core.queue_position
    feeder = CoreClient(core.address)
    errors: list[BaseException] = []

    def feed() -> None:
        try:
            feeder.open_step(seq)
            for lo in range(0, len(A), 2):
                if lo == 2:
                    until(
                        lambda: (
                            core.replicas().get(CRASHER, {}).get("claims", 0) > 0
                            or CRASHER in core.presumed_dead()
                        ),
                        "the crasher to claim",
                        120.0,
                    )
                    core.set_computing(True)
                    core.admit(SATS[0])
                feeder.add(seq, A[lo : lo + 2])
                time.sleep(0.05)
            feeder.close_step(seq, len(A))
        except BaseException as exc:
            errors.append(exc)

    th = threading.Thread(target=feed)
    th.start()
    try:
        step = core.next_step(60.0)
        assert step is not None
        first = core.train_step(step)
    finally:
        th.join(timeout=120)
        feeder.close()
        core.set_computing(True)
    assert not errors, errors
    assert CRASHER not in first.by_replica  # it died holding its claim and never delivered
    assert first.requeued >= 1 and first.microbatches == len(A)
    assert CRASHER in core.presumed_dead()
    cluster.procs[CRASHER].wait(timeout=30)
    assert cluster.procs[CRASHER].returncode == -9  # really killed, not a clean exit
    core.train_step(B)
    assert_close(cluster.weights(), reference)
