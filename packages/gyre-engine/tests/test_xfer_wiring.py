"""gyre-engine wired to gyre-xfer, across real processes: `gyre-engine serve` subprocesses, a gyre-xfer
publisher subprocess, bytes over Mooncake TCP on loopback and over shared memory.

(a) a weight update from a published snapshot changes greedy output to the new weights' and bumps the
version; bad snapshots and a dead publisher change nothing. (b) engine A hands an agent's cached prefix
to engine B; B continues it without re-prefill, exactly like a fresh prefill. (c) the source killed
mid-transfer: a clear error on the target within its timeout, nothing installed. (d) "cuda_ipc" between
engines off CUDA: offered over shared memory; an offer in a GPU's memory is refused by an engine that is
not on that GPU before anything is read, and `handoff_prefix` hands the prefix over shared memory instead.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from gyre_engine.client import EngineClient, EngineError, handoff_prefix
from gyre_engine.protocol import (
    CUDA_IPC_UNREACHABLE,
    PrefixOffer,
    PrefixTransport,
    SamplingParams,
    SuccessReply,
)

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.slow

SYSTEM = [1000 + i for i in range(37)]
USER = [1200 + i * 7 for i in range(9)]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
PUBLISHER = Path(__file__).with_name("xfer_publisher.py")

sys.path.insert(0, str(Path(__file__).parent))  # the shared helpers (tests run with --import-mode=importlib)
from ipc_offers import on_device  # noqa: E402


def run(coro: Any) -> Any:
    return asyncio.run(coro)


class PublisherProc:
    def __init__(self, lease_s: float = 60.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(PUBLISHER), str(lease_s)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        self.address: dict[str, str] = json.loads(self._line())

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"publisher exited with {self.proc.wait(10)}")
        return line

    def publish(self, cmd: str, kind: str, *model_dirs: Path) -> int:
        """Returns the version published (for `churn`: the version before the first churned one)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{cmd} {kind} {' '.join(map(str, model_dirs))}\n")
        self.proc.stdin.flush()
        return int(json.loads(self._line())["version"])

    def stop(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait(20)
        for f in (self.proc.stdin, self.proc.stdout):
            if not f.closed:
                f.close()


@pytest.fixture
def publisher() -> Iterator[PublisherProc]:
    p = PublisherProc()
    yield p
    p.stop()
    from gyre_xfer.shm import sweep_orphans

    sweep_orphans()


@pytest.fixture
def churning_publisher() -> Iterator[PublisherProc]:
    """A publisher whose leases expire at once, so it rewrites slots under a pull in progress."""
    p = PublisherProc(lease_s=0.0)
    yield p
    p.stop()
    from gyre_xfer.shm import sweep_orphans

    sweep_orphans()


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gyre_engine.server.model_factory import create_model

    return create_model(tmp_path_factory.mktemp("tiny1") / "model", shape="tiny", seed=1)


@pytest.fixture(scope="module")
def pair(spawn_server: Callable[..., Any]) -> Iterator[tuple[Any, Any]]:
    """Engines A and B (B notices a hung Mooncake peer after 2 s); each test leaves them as it found them.
    The segments of an engine killed meanwhile (its spare KV arenas) are removed afterwards."""
    a, b = spawn_server(wait=False), spawn_server("--xfer-progress-timeout", "2", wait=False)
    a.wait_ready()
    b.wait_ready()
    yield a, b
    from gyre_xfer.shm import sweep_orphans

    for p in (a, b):
        p.proc.poll()  # one killed meanwhile is reaped: its pid is gone, so its segments count as orphans
    sweep_orphans()


@pytest.mark.mooncake
def test_weight_update_from_a_published_snapshot(
    pair: tuple[Any, Any],
    publisher: PublisherProc,
    model_dir: Path,
    other_weights: Path,
    greedy_of: Callable[[Path, list[int], int], list[int]],
) -> None:
    srv = pair[0]
    ids = SYSTEM + USER
    new_ref = greedy_of(other_weights, ids, GREEDY.max_new_tokens)
    old_ref = greedy_of(model_dir, ids, GREEDY.max_new_tokens)
    assert new_ref != old_ref  # otherwise the test could not tell the weights apart
    mc, shm = publisher.address["mooncake"], publisher.address["shm"]

    async def go() -> None:
        async with EngineClient(srv.url, timeout_s=120) as c:
            assert (await c.generate(ids, GREEDY)).output_ids == old_ref
            v = publisher.publish("publish", "mooncake", other_weights)
            reply = await c.update_weights_from_xfer(mc, transport="mooncake", min_version=v, timeout_s=30)
            assert (reply.snapshot_version, reply.weight_version) == (v, str(v))
            assert reply.num_tensors > 0 and reply.nbytes > 0
            r = await c.generate(ids, GREEDY)
            assert r.output_ids == new_ref and r.meta_info.weight_version == str(v)

            # bad snapshots: refused with a clear error, the old version keeps serving
            for cmd, needle in (("bad-shape", "shape of"), ("missing", "lacks 1 parameters")):
                bad = publisher.publish(cmd, "mooncake", model_dir)
                with pytest.raises(EngineError, match=needle) as ei:
                    await c.update_weights_from_xfer(mc, transport="mooncake", min_version=bad, timeout_s=30)
                assert ei.value.status == 400
            with pytest.raises(EngineError, match="no version >= 99"):
                await c.update_weights_from_xfer(mc, transport="mooncake", min_version=99, timeout_s=30)
            r = await c.generate(ids, GREEDY)
            assert r.output_ids == new_ref and r.meta_info.weight_version == str(v)

            # a Megatron-layout trainer (fused QKV, fused gate/up): converted on the way in
            m = publisher.publish("megatron", "mooncake", model_dir)
            reply = await c.update_weights_from_xfer(
                mc, transport="mooncake", min_version=m, layout="megatron"
            )
            r = await c.generate(ids, GREEDY)
            assert r.output_ids == old_ref and r.meta_info.weight_version == str(m)

            # the other transport, with an explicit version label
            s = publisher.publish("publish", "shm", other_weights)
            reply = await c.update_weights_from_xfer(shm, min_version=s, transport="shm", weight_version="x")
            assert reply.snapshot_version == s
            r = await c.generate(ids, GREEDY)
            assert r.output_ids == new_ref and r.meta_info.weight_version == "x"

            # the publisher's process gone: a clear error within the control timeout, nothing changes
            publisher.proc.kill()
            publisher.proc.wait(20)
            t0 = time.monotonic()
            with pytest.raises(EngineError) as ei:
                await c.update_weights_from_xfer(
                    mc, transport="mooncake", min_version=1, timeout_s=10, control_timeout_s=3
                )
            took = time.monotonic() - t0
            print(f"dead publisher: HTTP {ei.value.status} after {took:.2f} s: {ei.value.message}")
            assert ei.value.status in (502, 504) and ("Peer" in ei.value.message)
            assert took < 3 + 10  # bounded by the configured timeouts (never a hang)
            r = await c.generate(ids, GREEDY)
            assert r.output_ids == new_ref and r.meta_info.weight_version == "x"
            await c.update_weights_from_disk(str(model_dir), weight_version="0")  # as the module found it

    run(go())


@pytest.mark.mooncake
def test_a_snapshot_rewritten_during_the_pull_is_never_loaded(
    pair: tuple[Any, Any],
    churning_publisher: PublisherProc,
    model_dir: Path,
    other_weights: Path,
    greedy_of: Callable[[Path, list[int], int], list[int]],
) -> None:
    """The publisher alternates two weight sets back to back and ignores leases: each load gets one
    whole version (the output is exactly that set's greedy output) or a clear 409, never a mix."""
    ids = SYSTEM + USER
    refs = [greedy_of(d, ids, GREEDY.max_new_tokens) for d in (model_dir, other_weights)]
    v0 = churning_publisher.publish("churn", "mooncake", model_dir, other_weights)

    async def go() -> dict[str, int]:
        seen = {"loaded": 0, "refused": 0}
        async with EngineClient(pair[0].url, timeout_s=60) as c:
            current = refs[0]
            for _ in range(8):
                try:
                    r = await c.update_weights_from_xfer(
                        churning_publisher.address["mooncake"], transport="mooncake", timeout_s=30
                    )
                    current = refs[(r.snapshot_version - v0 - 1) % 2]
                    seen["loaded"] += 1
                except EngineError as e:
                    assert (e.status, e.retryable) == (409, True), e.message
                    assert "SnapshotOverwrittenError" in e.message
                    seen["refused"] += 1
                out = await c.generate(ids, GREEDY)
                assert out.output_ids == current
            await c.update_weights_from_disk(str(model_dir), weight_version="0")
        return seen

    print(f"pulls under a publisher rewriting its slots: {run(go())}")


@pytest.mark.parametrize("transport", [pytest.param("mooncake", marks=pytest.mark.mooncake), "shm"])
def test_prefix_handoff_between_two_engines(pair: tuple[Any, Any], model_dir: Path, transport: str) -> None:
    a, b = pair

    async def go() -> None:
        async with EngineClient(a.url, timeout_s=60) as ca, EngineClient(b.url, timeout_s=60) as cb:
            await ca.flush_cache()
            await cb.flush_cache()
            first = await ca.generate(SYSTEM + USER, GREEDY)  # engine A serves the agent's call k
            context = SYSTEM + USER + first.output_ids + USER[:5]  # ... and this is call k + 1
            fresh = await cb.generate(context, GREEDY)  # a fresh prefill on B, for reference
            assert fresh.meta_info.cached_tokens == 0
            await cb.flush_cache()
            before = (await cb.server_info()).prefill_tokens_computed
            reply = await handoff_prefix(ca, cb, context, transport=transport, block_tokens=8)
            assert reply is not None and reply.success
            covered = len(SYSTEM + USER + first.output_ids) - 1  # the last output token has no KV yet
            assert reply.tokens == covered
            assert len(reply.blocks) == -(-covered // 8) and all(b.status == "OK" for b in reply.blocks)
            again = await cb.generate(context, GREEDY)
            assert again.meta_info.cached_tokens == covered
            assert (await cb.server_info()).prefill_tokens_computed - before == len(context) - covered
            assert again.output_ids == fresh.output_ids
            # the receipt freed the source's pool
            assert (await ca.server_info()).open_prefix_offers == 0
            with pytest.raises(EngineError, match="no open offer") as ei:
                await ca.release_prefix_offer("nope")
            assert ei.value.status == 404
            assert await ca.offer_prefix([7, 8, 9], transport=transport) is None
            for ids in (
                [2**63],
                [-1],
                [10**9],
            ):  # outside the vocabulary (past int64 too): a 400 that says so
                with pytest.raises(EngineError, match="outside the vocabulary") as ei:
                    await ca.offer_prefix(ids, transport=transport)
                assert ei.value.status == 400
                with pytest.raises(EngineError, match="outside the vocabulary") as ei:
                    await ca.export_prefix(ids)
                assert ei.value.status == 400

            # a prefix of other weights is refused before any byte moves
            offer = await ca.offer_prefix(context, transport=transport)
            assert offer is not None
            await cb.update_weights_from_disk(str(model_dir), weight_version="other")
            with pytest.raises(EngineError, match="weight_version") as ei:
                await cb.import_prefix_xfer(offer)
            assert ei.value.status == 400
            await ca.release_prefix_offer(offer.offer_id)
            await cb.update_weights_from_disk(str(model_dir), weight_version="0")

    run(go())


def test_a_terminated_engine_removes_its_shared_memory(spawn_server: Callable[..., Any]) -> None:
    """SIGTERM: the engine shuts down gracefully, removes its segments (here an open offer's arena; spare
    KV arenas alike), then ends by the signal as before."""
    from gyre_xfer.protocol import KvOffer
    from gyre_xfer.shm import SHM_DIR

    c = spawn_server()

    async def go() -> str:
        async with EngineClient(c.url, timeout_s=60) as cl:
            first = await cl.generate(SYSTEM + USER, GREEDY)
            offer = await cl.offer_prefix(SYSTEM + USER + first.output_ids, transport="shm")
            assert offer is not None
            return msgspec.json.decode(offer.kv_offer, type=KvOffer).pool.regions[0].shm_name

    segment = run(go())
    assert os.path.exists(os.path.join(SHM_DIR, segment))
    c.proc.terminate()
    assert c.proc.wait(30) == -signal.SIGTERM
    assert not [f for f in os.listdir(SHM_DIR) if f.startswith(f"gyre-{c.proc.pid}-")]


def test_cuda_ipc_between_engines_off_cuda_goes_over_shared_memory(pair: tuple[Any, Any]) -> None:
    from gyre_xfer.protocol import KvOffer

    a, b = pair

    async def go() -> None:
        async with EngineClient(a.url, timeout_s=60) as ca, EngineClient(b.url, timeout_s=60) as cb:
            await ca.flush_cache()
            await cb.flush_cache()
            first = await ca.generate(SYSTEM + USER, GREEDY)
            context = SYSTEM + USER + first.output_ids
            covered = len(context) - 1
            offer = await ca.offer_prefix(context, transport="cuda_ipc")
            assert offer is not None and offer.cuda_ipc is None  # no device memory to share
            assert msgspec.json.decode(offer.kv_offer, type=KvOffer).pool.transport.name == "SHM"
            await ca.release_prefix_offer(offer.offer_id)
            reply = await handoff_prefix(ca, cb, context, transport="cuda_ipc", block_tokens=8)
            assert reply is not None and reply.success and reply.transport == "shm"
            assert reply.tokens == covered and "over shm" in reply.message
            again = await cb.generate(context, GREEDY)
            assert again.meta_info.cached_tokens == covered
            assert (await ca.server_info()).open_prefix_offers == 0

    run(go())


class OnAGpu(EngineClient):
    """Engine A as if it were on a GPU: asked for "cuda_ipc", it answers what an engine on a GPU answers
    (an offer of a device buffer, `ipc_offers.on_device`, of the prefix A caches); everything else is A's
    own answer. Records every receipt."""

    def __init__(self, url: str, layers: int) -> None:
        super().__init__(url, timeout_s=60)
        self.layers = layers
        self.device_offers: list[PrefixOffer] = []
        self.receipts: list[tuple[str, list[int]]] = []

    async def offer_prefix(
        self,
        input_ids: list[int],
        *,
        transport: PrefixTransport = "shm",
        block_tokens: int = 16,
        lease_s: float = 120.0,
        timeout: float | None = None,
    ) -> PrefixOffer | None:
        if transport != "cuda_ipc":
            return await super().offer_prefix(input_ids, transport=transport, block_tokens=block_tokens)
        like = await super().offer_prefix(input_ids, block_tokens=block_tokens)
        assert like is not None
        await super().release_prefix_offer(like.offer_id)
        self.device_offers.append(on_device(like, self.layers, 4))  # the tiny model's KV is float32
        return self.device_offers[-1]

    async def release_prefix_offer(
        self, offer_id: str, arrived: list[int] | None = None, failed: list[int] | None = None
    ) -> SuccessReply:
        self.receipts.append((offer_id, list(arrived or [])))
        if any(o.offer_id == offer_id for o in self.device_offers):
            return SuccessReply(True, f"offer {offer_id} released")
        return await super().release_prefix_offer(offer_id, arrived, failed)


def test_an_offer_in_a_gpus_memory_is_refused_off_that_gpu_and_sent_over_shared_memory(
    pair: tuple[Any, Any], model_dir: Path
) -> None:
    a, b = pair
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]

    async def go() -> None:
        async with EngineClient(a.url, timeout_s=60) as ca, EngineClient(b.url, timeout_s=60) as cb:
            await ca.flush_cache()
            await cb.flush_cache()
            first = await ca.generate(SYSTEM + USER, GREEDY)
            context = SYSTEM + USER + first.output_ids
            covered = len(context) - 1
            gpu_a = OnAGpu(a.url, layers)
            async with gpu_a:
                offer = await gpu_a.offer_prefix(context, transport="cuda_ipc", block_tokens=8)
                assert offer is not None and offer.cuda_ipc is not None
                with pytest.raises(EngineError) as ei:
                    await cb.import_prefix_xfer(offer)
                assert ei.value.status == 409 and ei.value.err_type == CUDA_IPC_UNREACHABLE
                assert "this engine is on cpu" in ei.value.message
                assert (await cb.server_info()).cached_prefix_tokens == 0  # nothing read, nothing installed

                reply = await handoff_prefix(gpu_a, cb, context, transport="cuda_ipc", block_tokens=8)
                assert reply is not None and reply.success and reply.transport == "shm"
                assert reply.tokens == covered
                # the refused device offer was released with nothing arrived, the one over shm with all
                second = gpu_a.device_offers[1].offer_id
                assert gpu_a.receipts[0] == (second, [])
                assert gpu_a.receipts[1][1] == list(range(-(-covered // 8)))
            again = await cb.generate(context, GREEDY)
            assert again.meta_info.cached_tokens == covered
            assert (await ca.server_info()).open_prefix_offers == 0

            # without "cuda_ipc" asked for, such a refusal is the caller's error: no second way is tried
            with pytest.raises(EngineError, match="this engine is on cpu"):
                await handoff_prefix(FixedOffer(a.url, offer), cb, context, transport="shm")

    run(go())


class FixedOffer(EngineClient):
    """Engine A answering every offer request with one fixed offer (releases go nowhere)."""

    def __init__(self, url: str, offer: PrefixOffer) -> None:
        super().__init__(url, timeout_s=60)
        self.offer = offer

    async def offer_prefix(self, input_ids: list[int], **kw: Any) -> PrefixOffer | None:
        return self.offer

    async def release_prefix_offer(
        self, offer_id: str, arrived: list[int] | None = None, failed: list[int] | None = None
    ) -> SuccessReply:
        return SuccessReply(True, f"offer {offer_id} released")


@pytest.mark.mooncake
def test_source_killed_mid_transfer(pair: tuple[Any, Any]) -> None:
    """Kills engine A, so it stays the last test of this module (pytest runs a file in order); a spare
    engine of its own would cost another start-up of torch on a loaded 2-core machine. Over Mooncake TCP,
    where a transfer stalls in flight when its source stops."""
    a, b = pair

    async def go() -> None:
        async with EngineClient(a.url, timeout_s=60) as ca, EngineClient(b.url, timeout_s=60) as cb:
            await cb.flush_cache()
            first = await ca.generate(SYSTEM + USER, GREEDY)
            context = SYSTEM + USER + first.output_ids
            offer = await ca.offer_prefix(context, transport="mooncake")
            assert offer is not None
            os.kill(a.proc.pid, signal.SIGSTOP)  # the source hangs; the transfer will stall in flight
            try:
                t0 = time.monotonic()
                task = asyncio.create_task(cb.import_prefix_xfer(offer, timeout_s=4))
                await asyncio.sleep(1.0)
                os.kill(a.proc.pid, signal.SIGKILL)  # ... and dies in the middle of it
                with pytest.raises(EngineError) as ei:
                    await task
                took = time.monotonic() - t0
            finally:
                os.kill(a.proc.pid, signal.SIGCONT)
            print(
                f"source killed mid-transfer: HTTP {ei.value.status} after {took:.2f} s: {ei.value.message}"
            )
            assert ei.value.status in (502, 504) and "nothing was installed" in ei.value.message
            assert took < 4 + 10  # bounded by the configured timeout (never a hang)
            info = await cb.server_info()
            assert info.cached_prefix_tokens == 0  # nothing installed
            r = await cb.generate(context, GREEDY)
            assert r.meta_info.cached_tokens == 0

    run(go())
