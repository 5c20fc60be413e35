"""A cached prefix handed between two `gyre-engine serve` processes on the same GPU through CUDA IPC: the
importer's KV equals the exporter's bit for bit (both read back with /export_prefix), the importer serves
the continuation with the prefix cached, the receipt frees the offer, and a second import of a released
offer fails cleanly (nothing installed, the importer still serving). Also: a device offer the exporter
never saw imported, released by its lease, leaves the exporter serving. Skipped without CUDA."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from gyre_engine.client import EngineClient, EngineError, handoff_prefix
from gyre_engine.protocol import SamplingParams

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

pytestmark = pytest.mark.slow

SYSTEM = [1000 + i for i in range(37)]
USER = [1200 + i * 7 for i in range(9)]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
ON_GPU = ("--device", "cuda:0", "--dtype", "bfloat16", "--no-compile-decode")


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def pair(spawn_server: Callable[..., Any]) -> Iterator[tuple[Any, Any]]:
    """Engines A and B, both on cuda:0 (each its own process, as CUDA IPC needs)."""
    a, b = spawn_server(*ON_GPU, wait=False), spawn_server(*ON_GPU, wait=False)
    a.wait_ready()
    b.wait_ready()
    yield a, b


async def cached_context(ca: EngineClient, cb: EngineClient) -> tuple[list[int], int]:
    """Both caches flushed, then A serves a call: the next call's context, and the tokens of it A caches."""
    await ca.flush_cache()
    await cb.flush_cache()
    first = await ca.generate(SYSTEM + USER, GREEDY)
    context = SYSTEM + USER + first.output_ids + USER[:5]
    return context, len(SYSTEM + USER + first.output_ids) - 1  # the last output token has no KV yet


def test_prefix_handed_over_cuda_ipc_is_bit_exact_and_serves_the_continuation(pair: tuple[Any, Any]) -> None:
    a, b = pair

    async def go() -> None:
        async with EngineClient(a.url, timeout_s=120) as ca, EngineClient(b.url, timeout_s=120) as cb:
            context, covered = await cached_context(ca, cb)
            before = (await cb.server_info()).prefill_tokens_computed
            reply = await handoff_prefix(ca, cb, context, transport="cuda_ipc", block_tokens=8)
            assert reply is not None and reply.success, reply
            assert reply.transport == "cuda_ipc" and reply.tokens == covered
            assert len(reply.blocks) == -(-covered // 8) and all(x.status == "OK" for x in reply.blocks)
            # the receipt freed the exporter's device buffer
            assert (await ca.server_info()).open_prefix_offers == 0

            # the imported KV is the exporter's, bit for bit
            theirs = await ca.export_prefix(context)
            ours = await cb.export_prefix(context)
            assert theirs is not None and ours is not None
            assert ours.token_ids == theirs.token_ids and len(ours.token_ids) == covered
            assert (ours.dtype, ours.shape) == (theirs.dtype, theirs.shape) and ours.dtype == "bfloat16"
            assert ours.keys == theirs.keys and ours.values == theirs.values

            # and B continues from it: only the tokens past the prefix are prefilled
            again = await cb.generate(context, GREEDY)
            assert again.meta_info.cached_tokens == covered
            assert (await cb.server_info()).prefill_tokens_computed - before == len(context) - covered

    run(go())


def test_a_second_import_after_the_receipt_fails_cleanly(pair: tuple[Any, Any]) -> None:
    a, b = pair

    async def go() -> None:
        async with EngineClient(a.url, timeout_s=120) as ca, EngineClient(b.url, timeout_s=120) as cb:
            context, covered = await cached_context(ca, cb)
            offer = await ca.offer_prefix(context, transport="cuda_ipc", block_tokens=8)
            assert offer is not None and offer.cuda_ipc is not None
            assert offer.cuda_ipc.device_uuid == str(torch.cuda.get_device_properties(0).uuid)
            reply = await cb.import_prefix_xfer(offer)
            assert reply.success and reply.transport == "cuda_ipc" and reply.tokens == covered
            await ca.release_prefix_offer(offer.offer_id, arrived=[x.src_block for x in reply.blocks])
            assert (await ca.server_info()).open_prefix_offers == 0

            await cb.flush_cache()
            with pytest.raises(EngineError) as ei:
                await cb.import_prefix_xfer(offer)
            print(f"second import of a released offer: HTTP {ei.value.status}: {ei.value.message}")
            assert ei.value.status in (409, 502) and "nothing was installed" in ei.value.message
            assert (await cb.server_info()).cached_prefix_tokens == 0
            # the refused import left B's CUDA context usable: it serves, prefilling the whole context
            fresh = await cb.generate(context, GREEDY)
            assert fresh.meta_info.cached_tokens == 0 and len(fresh.output_ids) == GREEDY.max_new_tokens

    run(go())


def test_an_offer_never_imported_expires_and_the_exporter_keeps_serving(pair: tuple[Any, Any]) -> None:
    a, b = pair

    async def go() -> None:
        async with EngineClient(a.url, timeout_s=120) as ca, EngineClient(b.url, timeout_s=120) as cb:
            context, covered = await cached_context(ca, cb)
            offer = await ca.offer_prefix(context, transport="cuda_ipc", lease_s=0.5)
            assert offer is not None and offer.cuda_ipc is not None
            await asyncio.sleep(1.0)
            # the next offer sweeps the expired one (its buffer freed: the importer's reference given up)
            again = await ca.offer_prefix(context, transport="cuda_ipc")
            assert again is not None and (await ca.server_info()).open_prefix_offers == 1
            with pytest.raises(EngineError) as ei:
                await cb.import_prefix_xfer(offer)
            assert ei.value.status in (409, 502) and "nothing was installed" in ei.value.message
            reply = await cb.import_prefix_xfer(again)
            assert reply.success and reply.tokens == covered
            await ca.release_prefix_offer(again.offer_id, arrived=[x.src_block for x in reply.blocks])
            assert (await ca.server_info()).open_prefix_offers == 0
            served = await ca.generate(context, GREEDY)
            assert served.meta_info.cached_tokens == covered

    run(go())


def test_an_engine_short_of_free_gpu_memory_offers_over_shared_memory(
    spawn_server: Callable[..., Any], pair: tuple[Any, Any]
) -> None:
    # An engine that keeps 2 GiB of the GPU free: with less than that left (a tensor of this process takes
    # the rest), a cuda_ipc offer is made over shared memory instead of a device copy, and B takes it.
    _, b = pair
    keeper = spawn_server(*ON_GPU, "--min-free-gib", "2")

    async def go() -> None:
        async with EngineClient(keeper.url, timeout_s=120) as ck, EngineClient(b.url, timeout_s=120) as cb:
            context, covered = await cached_context(ck, cb)
            free = int(torch.cuda.mem_get_info(0)[0])
            blocker = torch.empty(
                max(0, free - (3 << 29)), dtype=torch.uint8, device="cuda:0"
            )  # 1.5 GiB left
            try:
                offer = await ck.offer_prefix(context, transport="cuda_ipc", block_tokens=8)
                assert offer is not None and offer.cuda_ipc is None  # a shared-memory offer
                reply = await cb.import_prefix_xfer(offer)
                assert reply.success and reply.transport == "shm" and reply.tokens == covered
                await ck.release_prefix_offer(offer.offer_id, arrived=[x.src_block for x in reply.blocks])
            finally:
                del blocker
                torch.cuda.empty_cache()
            again = await ck.offer_prefix(context, transport="cuda_ipc", block_tokens=8)  # room again
            assert again is not None and again.cuda_ipc is not None
            await ck.release_prefix_offer(again.offer_id)

    run(go())
