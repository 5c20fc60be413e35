"""The core with satellites on real ZeroMQ sockets and real gyre-xfer snapshots (satellites as threads
here; as processes in test_processes.py): mu > 1, checkpoint/resume, snapshots for engines, staleness,
and refusal of malformed input."""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
import zmq
from gyre_base.testing import until
from gyre_train.checkpoint import CheckpointError
from gyre_train.control import CoreClient
from gyre_train.core import Core, CoreConfig
from gyre_train.data import synthetic_minibatch
from gyre_train.model import ModelConfig, build_model
from gyre_train.protocol import (
    PROTOCOL,
    Ack,
    Bucket,
    CellShape,
    ErrorCode,
    ErrorReply,
    Gradient,
    Hello,
    Welcome,
    reply_decoder,
)
from gyre_train.satellite import Satellite, SatelliteConfig
from gyre_train.wire import MicroBatchError
from gyre_traj.loss import LossConfig

MC = ModelConfig()
A = synthetic_minibatch(4, seed=1)
B = synthetic_minibatch(4, seed=2)


def new_core(**kw: object) -> Core:
    return Core(build_model(MC), MC, CoreConfig(token_budget=512, **kw))  # type: ignore[arg-type]


def weights(core: Core) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in core.model.named_parameters()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(a[n], b[n], atol=atol, rtol=0.0, msg=n)


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    core = new_core()
    try:
        core.train_burst([A, B])
        return weights(core)
    finally:
        core.close()


def test_a_warmed_up_core_trains_as_one_that_was_not(reference: dict[str, torch.Tensor]) -> None:
    # The warm-up computes synthetic micro-batches as a step would and applies nothing: same weights,
    # version and (after the burst) the same weights as the reference, bit for bit.
    core = new_core()
    try:
        before = weights(core)
        core.set_computing(False)  # as the cell leaves it: the warm-up computes anyway, then restores it
        assert core.warm_up(2) > 0.0 and core.version == 0
        assert_same(weights(core), before)
        core.set_computing(True)
        # the feeder's steps start at queue position 0, as in a run: the warm-up took none of them
        feeder = CoreClient(core.address)
        for pos, mb in enumerate((A, B)):
            feeder.submit(pos, mb)
            core.train_step(core.next_step(5.0))
        assert core.version == 2 and core.queue_position == 2
        assert_same(weights(core), reference)
        feeder.close()
    finally:
        core.close()
    small = Core(build_model(MC), MC, CoreConfig(token_budget=64))
    try:  # a budget below the synthetic agent's paths: nothing to warm up with, said and skipped
        assert small.warm_up(2) == 0.0 and small.version == 0
    finally:
        small.close()


def test_the_warm_up_trains_a_micro_batch_in_chunks_where_the_core_chunks(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # With a chunk budget, each warm-up round adds a micro-batch above it, for the core and for a
    # satellite (whose budget comes in the Welcome): the chunked path's kernels compile before real
    # steps as well. Nothing is applied.
    import gyre_train.chunked as chunked

    sizes: list[tuple[int, int]] = []
    real = chunked.chunked_loss_backward

    def spy(model: torch.nn.Module, batch: object, budget: int, *a: object, **kw: object) -> dict[str, float]:
        sizes.append((batch.num_tokens, budget))  # type: ignore[attr-defined]
        return real(model, batch, budget, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(chunked, "chunked_loss_backward", spy)
    caplog.set_level("INFO", logger="gyre_train.core")
    core = Core(build_model(MC), MC, CoreConfig(token_budget=2000, chunk_budget=700))
    sat = None
    try:
        before = weights(core)
        assert core.warm_up(2) > 0.0 and core.version == 0
        assert_same(weights(core), before)
        assert len(sizes) == 2 and all(budget < n <= 2000 for n, budget in sizes)
        assert sizes[0][0] != sizes[1][0]  # lengths differ by round: the dynamic-shape kernels compile
        for n, _ in sizes:  # each micro-batch's log line says its tokens (and, on a GPU, the peak memory)
            assert any(f"({n} tokens) computed in" in r.getMessage() for r in caplog.records)
        sat = Satellite(SatelliteConfig(core.address, "sat-c", warmup=2))
        assert len(sizes) == 4 and all(budget == 700 < n for n, budget in sizes[2:])
    finally:
        core.close()
        if sat is not None:
            sat.close()


@pytest.fixture
def core_and_satellite() -> Iterator[tuple[Core, Satellite]]:
    core = new_core()
    sat = Satellite(SatelliteConfig(core.address, "sat-t", warmup=2))  # warm-up as on a GPU
    th = threading.Thread(target=sat.run, daemon=True)
    th.start()
    try:
        yield core, sat
    finally:
        core.close()
        th.join(timeout=30)
        sat.close()


def test_mu_2_burst_with_a_satellite_equals_one_replica(
    core_and_satellite: tuple[Core, Satellite], reference: dict[str, torch.Tensor]
) -> None:
    core, sat = core_and_satellite

    def join_after_first(k: int) -> None:
        if k == 1:
            core.admit("sat-t")
            until(lambda: core.replicas()["sat-t"]["claims"] > 0, "sat-t to claim", 60.0)

    assert sat.warmup_s > 0 and sat.snapshot == core.snapshot  # pulled and computed at start
    reports = core.train_burst([A, B], on_progress=join_after_first)
    assert [r.version for r in reports] == [1, 2]
    assert core.replicas()["sat-t"]["last_handoff_s"] > 0  # read through gyre-xfer (shared memory here)
    assert reports[0].by_replica.get("sat-t", 0) > 0
    assert sum(r.by_replica.get("sat-t", 0) for r in reports) >= 1
    assert sat.snapshot in (
        reports[0].snapshot - 1,
        reports[1].snapshot - 1,
    )  # pulled the version it computed at
    assert_same(weights(core), reference)  # the same floats: gradients are summed in micro-batch order


def test_checkpoint_resume_gives_the_same_next_update(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    first = new_core()
    first.train_step(A)
    first.save(tmp_path / "ck")
    first.close()
    resumed = new_core()
    try:
        resumed.load(tmp_path / "ck")
        assert (resumed.step, resumed.version, resumed.queue_position) == (1, 1, 1)
        r = resumed.train_step(B)
        assert (r.step, r.version, r.queue_position) == (2, 2, 2)
        assert_same(weights(resumed), reference)
    finally:
        resumed.close()
    other = Core(build_model(dataclasses.replace(MC, hidden_size=32)), MC, CoreConfig())
    try:
        with pytest.raises(CheckpointError, match="layout"):
            other.load(tmp_path / "ck")
    finally:
        other.close()


def test_each_version_is_a_snapshot_an_engine_loads() -> None:
    from gyre_xfer.loader import WeightLoader
    from gyre_xfer.subscriber import SubscriberConfig
    from gyre_xfer.transport import Config, open_transport

    core = new_core()
    engine = build_model(dataclasses.replace(MC, seed=99))  # an engine's differently initialised copy
    tr = open_transport(Config(kind="shm"))
    try:
        r = core.train_step(A)
        loader = WeightLoader(
            tr, SubscriberConfig(publisher=core.publisher.address), dict(engine.named_parameters())
        )
        res = loader.load(min_version=r.snapshot)
        assert res.version == r.snapshot == core.snapshot
        assert_same({n: p.detach() for n, p in engine.named_parameters()}, weights(core))
        ids = torch.as_tensor(A[0].input_ids[:64], dtype=torch.long)[None]
        with torch.no_grad():
            torch.testing.assert_close(engine(ids).logits, core.model(ids).logits, atol=0.0, rtol=0.0)
        loader.close()
    finally:
        tr.close()
        core.close()


def test_staleness_is_reported_and_future_versions_refused() -> None:
    core = new_core()
    try:
        core.train_step(A)
        core.train_step(B)
        old = [
            dataclasses.replace(b, versions=np.where(np.arange(b.num_loss_tokens) % 2, 0, 2).astype(np.int32))
            for b in A
        ]
        r = core.train_step(old)
        n0 = sum(int((b.versions == 0).sum()) for b in old)
        n2 = sum(int((b.versions == 2).sum()) for b in old)
        assert r.staleness.tokens_by_lag == {0: n2, 2: n0}
        assert r.staleness.max == 2
        future = [dataclasses.replace(A[0], versions=np.full(A[0].num_loss_tokens, 9, np.int32))]
        with pytest.raises(MicroBatchError, match="version 9, newer than the trainer's 3"):
            core.train_step(future)
    finally:
        core.close()


def test_malformed_minibatch_is_refused_whole_and_loses_nothing() -> None:
    core = new_core()
    try:
        before = weights(core)
        bad = [*A[:2], dataclasses.replace(A[2], last_desc=np.zeros_like(A[2].last_desc))]
        with pytest.raises(MicroBatchError, match="micro-batch 2: malformed"):
            core.train_step(bad)
        with pytest.raises(MicroBatchError, match="over the micro-batch budget of 512"):
            big = max(A, key=lambda b: b.num_tokens)
            assert 2 * big.num_tokens > 512
            core.train_step([dataclasses.replace(big, **_doubled(big))])
        assert (core.step, core.version, core.queue_position) == (0, 0, 0)
        assert_same(weights(core), before)
        core.train_step(A)  # and the core still trains afterwards
        assert core.version == 1
    finally:
        core.close()


def _doubled(b: object) -> dict[str, np.ndarray]:
    """The same micro-batch twice over (two roots), so it is twice the tokens."""
    t = b.num_tokens  # type: ignore[attr-defined]
    out = {}
    for k in ("input_ids", "position_ids", "segment"):
        a = getattr(b, k)
        out[k] = np.concatenate([a, a])
    out["parent"] = np.concatenate([b.parent, np.where(b.parent >= 0, b.parent + t, -1)]).astype(np.int32)  # type: ignore[attr-defined]
    out["last_desc"] = np.concatenate([b.last_desc, b.last_desc + t]).astype(np.int32)  # type: ignore[attr-defined]
    return out


def test_bad_peers_get_clear_errors() -> None:
    core = new_core()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(core.address)
    enc, dec = msgspec.msgpack.Encoder(), reply_decoder()

    def ask(frames: list[bytes]) -> object:
        s.send_multipart(frames)
        assert s.poll(10_000), "core did not answer"
        return dec.decode(s.recv_multipart()[0])

    try:
        r = ask([enc.encode(Hello(PROTOCOL + 1, "x"))])
        assert isinstance(r, ErrorReply) and r.code == ErrorCode.PROTOCOL
        r = ask([b"\x93garbage"])
        assert isinstance(r, ErrorReply) and r.code == ErrorCode.PROTOCOL
        r = ask([enc.encode(Gradient("nobody", 0, 0, 0, ()))])
        assert isinstance(r, ErrorReply) and r.code == ErrorCode.UNKNOWN_REPLICA
        r = ask([enc.encode(Hello(PROTOCOL, "tp2", CellShape(tp=2)))])  # a split cell of another shape
        assert isinstance(r, ErrorReply) and r.code == ErrorCode.PROTOCOL
        assert "satellite cell of tp 2 x pp 1 x dp 1 beside a core of tp 1 x pp 1 x dp 1" in r.message
        assert isinstance(ask([enc.encode(Hello(PROTOCOL, "x"))]), Welcome)
        r = ask([enc.encode(Gradient("x", 0, 0, 0, ())), b"\x00" * 8])  # gradients are never frames
        assert isinstance(r, ErrorReply) and r.code == ErrorCode.BAD_GRADIENT and "no frames" in r.message
        # A gradient for a micro-batch nobody claimed is refused before anything is read.
        r = ask([enc.encode(Gradient("x", 1, 0, 0, ()))])
        assert isinstance(r, Ack) and not r.accepted and "not in progress" in r.reason
    finally:
        s.close()
        ctx.term()
        core.close()


def test_bad_gradient_headers_are_refused_and_the_claim_survives() -> None:
    # A satellite holding a claim sends headers that do not describe the core's shard (wrong dtype, size,
    # buckets, a range outside its region, a segment that is not there): each is refused, nothing is
    # summed, and a good gradient for the same claim is still taken.
    from gyre_train.handoff import GradStaging
    from gyre_xfer.transport import Config, open_transport

    core = new_core(core_computes=False)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(core.address)
    enc, dec = msgspec.msgpack.Encoder(), reply_decoder()
    tr = open_transport(Config(kind="shm"))
    staging = GradStaging(tr, core.layout.numel, "float32", bucket_bytes=4096)
    staging.slot(0).copy_(torch.arange(core.layout.numel, dtype=torch.float32))

    def ask(msg: object) -> object:
        s.send_multipart([enc.encode(msg)])
        assert s.poll(10_000), "core did not answer"
        return dec.decode(s.recv_multipart()[0])

    out: list[object] = []
    th = threading.Thread(target=lambda: out.append(core.train_step(A[:1])))
    try:
        assert isinstance(ask(Hello(PROTOCOL, "x")), Welcome)
        core.admit("x")
        th.start()
        from gyre_train.protocol import Assign, Claim

        a = ask(Claim("x", -1))
        assert isinstance(a, Assign)
        good = staging.describe(0, rank=0)
        n = core.layout.numel
        bad = [
            (msgspec.structs.replace(good, dtype="bfloat16"), "bfloat16"),
            (msgspec.structs.replace(good, numel=n - 1), "elements"),
            (msgspec.structs.replace(good, buckets=good.buckets[1:]), "tile"),
            (msgspec.structs.replace(good, buckets=(*good.buckets, Bucket(n, 1))), "cover"),
            (msgspec.structs.replace(good, offset=8), "inside"),
            (msgspec.structs.replace(good, rank=1), "ranks 0..0"),
        ]
        for shard, why in bad:
            r = ask(Gradient("x", a.batch, a.index, a.version, (shard,)))
            assert isinstance(r, ErrorReply) and r.code == ErrorCode.BAD_GRADIENT and why in r.message, (
                why,
                r,
            )
        gone = msgspec.structs.replace(
            good, region=msgspec.structs.replace(good.region, shm_name="gyre-1-0-9")
        )
        r = ask(Gradient("x", a.batch, a.index, a.version, (gone,)))  # the transfer fails: re-queued
        assert isinstance(r, Ack) and not r.accepted and "transfer failed" in r.reason
        a = ask(Claim("x", -1))
        assert isinstance(a, Assign)
        r = ask(Gradient("x", a.batch, a.index, a.version, (good,)))
        assert isinstance(r, Ack) and r.accepted
        th.join(timeout=30)
        assert out and out[0].by_replica == {"x": 1}  # type: ignore[attr-defined]
    finally:
        staging.close()
        tr.close()
        s.close()
        ctx.term()
        core.close()


@pytest.mark.mooncake
def test_chunked_microbatches_in_the_core_and_a_satellite_match_unchunked() -> None:
    big = synthetic_minibatch(4, seed=6, token_budget=1500)  # micro-batches several times the chunk budget
    cfg = dict(token_budget=1500, loss=LossConfig(mode="tis"))
    plain = Core(build_model(MC), MC, CoreConfig(**cfg))  # type: ignore[arg-type]
    try:
        plain.train_step(big)
        want = weights(plain)
    finally:
        plain.close()
    # Over Mooncake TCP this time (snapshots and gradients): the transport clusters use, with RDMA.
    core = Core(build_model(MC), MC, CoreConfig(chunk_budget=200, transport="mooncake", **cfg))  # type: ignore[arg-type]
    sat = Satellite(SatelliteConfig(core.address, "sat-c"))
    th = threading.Thread(target=sat.run, daemon=True)
    th.start()
    try:
        core.admit("sat-c")
        until(lambda: core.replicas().get("sat-c", {}).get("ready", False), "sat-c ready", 60.0)
        r = core.train_step(
            big,
            on_progress=lambda k: until(
                lambda: core.replicas()["sat-c"]["claims"] > 0, "sat-c to claim", 60.0
            ),
        )
        assert r.by_replica.get("sat-c", 0) >= 1 and max(b.num_tokens for b in big) > 200
        assert_same(weights(core), want, atol=1e-6)
    finally:
        core.close()
        th.join(timeout=30)
        sat.close()


def test_bfloat16_wire_is_the_same_whoever_computes_and_rounds_each_gradient(
    reference: dict[str, torch.Tensor],
) -> None:
    # With gradients handed over in bf16, a core with a satellite that joins mid-step ends with the same
    # bits as the core alone with the bf16 wire dtype (each micro-batch's gradient rounded once, wherever
    # it was computed), and not with the float32 result.
    alone = new_core(wire_dtype="bfloat16")
    try:
        alone.train_burst([A, B])
        want = weights(alone)
    finally:
        alone.close()
    core = new_core(wire_dtype="bfloat16")
    sat = Satellite(SatelliteConfig(core.address, "sat-bf16"))
    th = threading.Thread(target=sat.run, daemon=True)
    th.start()
    try:

        def join_after_first(k: int) -> None:
            if k == 1:
                core.admit("sat-bf16")
                until(lambda: core.replicas()["sat-bf16"]["claims"] > 0, "sat-bf16 to claim", 60.0)

        reports = core.train_burst([A, B], on_progress=join_after_first)
        assert sum(r.by_replica.get("sat-bf16", 0) for r in reports) >= 1
        assert_same(weights(core), want)
        assert any(not torch.equal(want[n], reference[n]) for n in want)
    finally:
        core.close()
        th.join(timeout=30)
        sat.close()


def test_a_controller_admits_and_dismisses_over_the_socket() -> None:
    from gyre_train.control import ControlError, CoreClient

    core = new_core()
    sat = Satellite(SatelliteConfig(core.address, "sat-x"))
    th = threading.Thread(target=sat.run, daemon=True)
    th.start()
    ctl = CoreClient(core.address)
    try:
        until(lambda: ctl.status().replicas and ctl.status().replicas[0].ready, "sat-x ready", 60.0)
        st = ctl.status()
        assert (st.version, st.pending, [r.name for r in st.replicas]) == (0, 0, ["sat-x"])
        assert not st.replicas[0].admitted
        ctl.admit("sat-x")
        r = core.train_step(
            A,
            on_progress=lambda k: until(
                lambda: core.replicas()["sat-x"]["claims"] > 0, "sat-x to claim", 60.0
            ),
        )
        assert r.by_replica.get("sat-x", 0) >= 1
        info = ctl.status().replicas[0]
        assert info.admitted and info.gradients >= 1 and info.join_s > 0
        ctl.dismiss("sat-x")
        r = core.train_step(B)
        assert set(r.by_replica) == {"core"}
        assert ctl.status().version == 2
    finally:
        ctl.close()
        core.close()
        th.join(timeout=30)
        sat.close()
    dead = CoreClient(core.address, timeout_s=0.3)
    try:
        with pytest.raises(ControlError, match="did not answer"):
            dead.status()
    finally:
        dead.close()


def test_the_trajectory_service_feeds_minibatches_in_order(reference: dict[str, torch.Tensor]) -> None:
    from gyre_train.control import ControlError, CoreClient

    core = new_core(inbox=2)
    feeder = CoreClient(core.address)
    try:
        bad = [*A[:1], dataclasses.replace(A[1], input_ids=A[1].input_ids + 10_000)]
        with pytest.raises(ControlError, match="micro-batch 1: input_ids outside the vocabulary"):
            feeder.submit(0, bad)
        with pytest.raises(ControlError, match="out of order: the core expects 0"):
            feeder.submit(1, B)
        feeder.submit(0, A)
        feeder.submit(1, B)
        with pytest.raises(ControlError, match="out of order: the core expects 2"):
            feeder.submit(1, B)  # a repeat is refused, not trained twice
        with pytest.raises(ControlError, match="inbox full"):
            feeder.submit(2, A)
        for _ in range(2):
            mb = core.next_step(timeout_s=5)
            assert mb is not None
            core.train_step(mb)
        assert core.next_step(timeout_s=0.05) is None
        assert core.queue_position == 2
        assert_same(weights(core), reference)  # the fed arrays trained exactly like the originals
    finally:
        feeder.close()
        core.close()


def test_a_satellite_presumed_dead_rejoins_and_the_step_is_unchanged(
    reference: dict[str, torch.Tensor],
) -> None:
    # Heartbeats far apart and a short death limit: the satellite is declared dead again and again
    # (while parked and while computing), its claims re-queued; it says hello again and carries on.
    core = new_core(heartbeat_s=30.0, dead_after_s=0.005, idle_hold_s=0.02)
    sat = Satellite(SatelliteConfig(core.address, "sat-slow"))
    th = threading.Thread(target=sat.run, daemon=True)
    th.start()
    try:
        core.admit("sat-slow")
        core.train_burst([A, B])
        assert sat.rejoins >= 1
        assert_same(weights(core), reference)
    finally:
        core.close()
        th.join(timeout=30)
        sat.close()


def test_state_dict_round_trips_in_memory(reference: dict[str, torch.Tensor]) -> None:
    import copy

    first = new_core()
    try:
        first.train_step(A)
        state = copy.deepcopy(first.state_dict())
        assert state["position"] == {"step": 1, "version": 1, "queue_position": 1}
        assert set(state["optimizer"]["state"]) == set(state["model"])  # by parameter name
    finally:
        first.close()
    resumed = new_core()
    try:
        resumed.load_state_dict(state)
        assert (resumed.step, resumed.version, resumed.queue_position) == (1, 1, 1)
        resumed.train_step(B)
        assert_same(weights(resumed), reference)
        bad = copy.deepcopy(state)
        bad["layout"] = "0" * 16
        with pytest.raises(CheckpointError, match="layout"):
            resumed.load_state_dict(bad)
    finally:
        resumed.close()


def test_replicas_give_device_memory_back_once_they_stop_computing(
    core_and_satellite: tuple[Core, Satellite],
    reference: dict[str, torch.Tensor],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cell that goes back to rollout mid-step leaves its micro-batch in hand to finish; then the core
    (and a dismissed satellite, at its next idle claim) hands the allocator's idle blocks back, so the
    engine beside it finds the memory training used. The step's result is unchanged."""
    import gyre_train.core as core_mod
    import gyre_train.satellite as sat_mod

    calls: dict[str, int] = {"core": 0, "sat": 0}

    def counter(who: str) -> object:
        def release() -> int:
            calls[who] += 1
            return 1024

        return release

    monkeypatch.setattr(core_mod, "release_cached_memory", counter("core"))
    monkeypatch.setattr(sat_mod, "release_cached_memory", counter("sat"))
    core, sat = core_and_satellite

    def leave_after_first(k: int) -> None:
        if k == 1:
            core.admit("sat-t")
            core.set_computing(False)  # the core's cell goes back to rollout; the satellite finishes

    r1 = core.train_step(A, on_progress=leave_after_first)
    assert calls["core"] >= 1 and core.released_bytes == 1024 * calls["core"]
    before = calls["core"]
    core.set_computing(True)
    r2 = core.train_step(B)
    assert calls["core"] == before  # computing all along: the cache stays for the next micro-batch
    assert [r1.version, r2.version] == [1, 2]
    assert_same(weights(core), reference)
    assert r1.by_replica.get("sat-t", 0) >= 1  # the satellite finished what the core left
    core.dismiss("sat-t")
    until(lambda: calls["sat"] >= 1, "the dismissed satellite to give its cache back", 30.0)
    assert sat.released_bytes >= 1024


def test_a_satellite_gives_its_warm_up_memory_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The warm-up's activations go back to the driver at its end, before any claim: the rollout engine
    of the satellite's cell starts on the same GPU right after (kept, they ran both engines out of
    memory on an H200)."""
    import gyre_train.satellite as sat_mod

    released: list[int] = []

    def release() -> int:
        released.append(1)
        return 4096

    monkeypatch.setattr(sat_mod, "release_cached_memory", release)
    core = new_core()
    try:
        sat = Satellite(SatelliteConfig(core.address, "sat-w", warmup=1))
        try:
            assert sat.warmup_s > 0 and sat.claims == 0
            assert released == [1] and sat.released_bytes == 4096
        finally:
            sat.close()
    finally:
        core.close()


def test_release_cached_memory_is_a_no_op_where_cuda_was_never_used() -> None:
    from gyre_train.devmem import release_cached_memory

    assert release_cached_memory() == 0
    assert not torch.cuda.is_initialized()  # asking did not start CUDA


def test_a_trainer_takes_expandable_segments_unless_its_environment_says_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a GPU the trainer's allocator gets expandable segments (set on the allocator, not in the
    environment its engine processes inherit); a PYTORCH_CUDA_ALLOC_CONF of the user's wins; no GPU, no
    change."""
    from gyre_train import devmem

    set_to: list[str] = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", set_to.append, raising=False)
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", set_to.append)
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not devmem.use_expandable_segments() and set_to == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert devmem.use_expandable_segments() and set_to == ["expandable_segments:True"]
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    assert not devmem.use_expandable_segments() and set_to == ["expandable_segments:True"]
