"""Control endpoints against a real server subprocess: abort, pause/continue, weight updates,
memory release/resume, flush, model info and health. Each test leaves the server as it found it."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from gyre_engine.client import EngineClient, EngineError
from gyre_engine.protocol import SamplingParams

torch = pytest.importorskip("torch")
import sys  # noqa: E402

from gyre_engine.server.batch import cache_from_layers, cache_kwarg  # noqa: E402
from safetensors.torch import save  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # the shared helpers (tests run with --import-mode=importlib)
from sglang_shapes import fixture as sglang_fixture  # noqa: E402

Greedy = Callable[[list[int], int], list[int]]
USER = [1200 + i * 7 for i in range(9)]
LONG = SamplingParams(max_new_tokens=20000, temperature=0.0, ignore_eos=True)
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _first_chunk_then(c: EngineClient, rid: str, action: Any) -> list[Any]:
    """Stream a long request; after its first chunk run `action`; return all chunks."""
    chunks = []
    async for ch in c.stream(USER, LONG, rid=rid):
        chunks.append(ch)
        if len(chunks) == 1:
            await action()
    return chunks


def test_abort_by_rid_ends_the_request_with_an_abort_reason(server: Any) -> None:
    async def go() -> list[Any]:
        async with EngineClient(server.url, timeout_s=60) as c:
            return await _first_chunk_then(c, "victim", lambda: c.abort("victim"))

    chunks = run(go())
    fr = chunks[-1].meta_info.finish_reason
    assert fr is not None and fr.type == "abort"
    assert len(chunks[-1].output_ids) < 20000


def test_abort_all(server: Any) -> None:
    async def go() -> list[Any]:
        async with EngineClient(server.url, timeout_s=60) as c:
            tasks = [asyncio.create_task(c.generate(USER, LONG, rid=f"a{i}")) for i in range(3)]
            while (await c.server_info()).running_requests < 3:
                await asyncio.sleep(0.05)
            await c.abort_all()
            return list(await asyncio.gather(*tasks))

    for r in run(go()):
        assert r.meta_info.finish_reason.type == "abort"


def test_pause_in_place_then_continue_keeps_the_request_exact(server: Any, greedy: Greedy) -> None:
    sp = SamplingParams(max_new_tokens=120, temperature=0.0, ignore_eos=True)

    async def go() -> tuple[Any, int, int]:
        async with EngineClient(server.url, timeout_s=60) as c:
            task = asyncio.create_task(c.generate(USER, sp, rid="paused"))
            while (await c.server_info()).decode_tokens == 0 or (await c.server_info()).running_requests == 0:
                await asyncio.sleep(0.02)
            await c.pause("in_place")
            info = await c.server_info()
            assert info.paused and info.running_requests == 1  # paused mid-request
            a = info.decode_tokens
            # the engine's time counters have run; no CUDA here, so no graph was captured
            assert info.decode_time_s > 0 and info.prefill_time_s > 0
            assert (info.graph_captures, info.graph_capture_s, info.slot_grows) == (0, 0.0, 0)
            await asyncio.sleep(0.3)
            b = (await c.server_info()).decode_tokens
            with pytest.raises(EngineError) as info:
                await c.generate(USER, GREEDY)
            assert info.value.status == 409 and info.value.retryable
            assert not await c.health_generate()
            await c.continue_generation()
            return await task, a, b

    r, a, b = run(go())
    assert a == b  # nothing stepped while paused
    assert r.meta_info.finish_reason.type == "length"
    assert r.output_ids == greedy(USER, 120)


def test_pause_abort_and_retract(server: Any, greedy: Greedy) -> None:
    async def go(mode: str, sp: SamplingParams) -> Any:
        async with EngineClient(server.url, timeout_s=60) as c:
            task = asyncio.create_task(c.generate(USER, sp))
            while (await c.server_info()).running_requests == 0:
                await asyncio.sleep(0.02)
            reply = await c.pause(mode)
            assert "1 requests affected" in reply.message  # it was still running
            await asyncio.sleep(0.1)
            await c.continue_generation()
            return await task

    aborted = run(go("abort", LONG))
    assert aborted.meta_info.finish_reason.type == "abort"
    sp = SamplingParams(max_new_tokens=120, temperature=0.0, ignore_eos=True)
    retracted = run(go("retract", sp))  # dropped its KV, re-prefilled on continue: same greedy continuation
    assert retracted.output_ids == greedy(USER, 120)


def _perturbed(hf_model: Any, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        n: p.detach() + 0.3 * torch.randn(p.shape, generator=g)
        for n, p in hf_model.named_parameters()
        if n.endswith("weight") and p.dim() == 2
    }


def test_weight_update_from_tensor_then_back_from_disk(
    server: Any, hf_model: Any, greedy: Greedy, model_dir: Path
) -> None:
    new = _perturbed(hf_model, 1)
    ref = type(hf_model).from_pretrained(model_dir, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for n, t in new.items():
            ref.get_parameter(n).copy_(t)
        expected = ref.generate(
            torch.tensor([USER]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    expected_ids = expected[0, len(USER) :].tolist()
    assert expected_ids != greedy(USER, 16)
    payload = base64.b64encode(save({k: v.contiguous() for k, v in new.items()})).decode()

    async def go() -> None:
        async with EngineClient(server.url, timeout_s=60) as c:
            v0 = (await c.model_info()).weight_version
            assert (await c.begin_weight_update()).success
            reply = await c.update_weights_from_tensor([payload], load_format="safetensors")
            assert reply.success
            assert (await c.end_weight_update()).success
            v1 = (await c.model_info()).weight_version
            assert v1 != v0
            r = await c.generate(USER, GREEDY)
            assert r.output_ids == expected_ids and r.meta_info.weight_version == v1
            # back to the checkpoint on disk, with an explicit version
            back = await c.update_weights_from_disk(str(model_dir), weight_version="restored")
            assert back.success
            r = await c.generate(USER, GREEDY)
            assert r.output_ids == greedy(USER, 16) and r.meta_info.weight_version == "restored"

    run(go())


def test_a_weight_update_lands_between_two_tokens_of_a_running_request(
    server: Any, hf_model: Any, model_dir: Path, greedy: Greedy
) -> None:
    """Each streamed token carries the version that computed it. Tokens before the switch are the old
    weights' greedy output; after it, the new weights continue on the KV the old ones left (in-place
    update): exactly what a reference that switches models between two tokens produces."""
    new = _perturbed(hf_model, 2)
    payload = base64.b64encode(save({k: v.contiguous() for k, v in new.items()})).decode()
    sp = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)

    async def go() -> list[Any]:
        async with EngineClient(server.url, timeout_s=60) as c:
            chunks = []
            async for ch in c.stream(USER, sp, rid="long"):
                chunks.append(ch)
                if len(chunks) == 5:
                    await c.begin_weight_update()
                    await c.update_weights_from_tensor(
                        [payload], load_format="safetensors", weight_version="mid"
                    )
                    await c.end_weight_update()
                if ch.meta_info.weight_version == "mid" and len(chunks[-1].output_ids) > 40:
                    await c.abort("long")
            await c.update_weights_from_disk(str(model_dir))
            return chunks

    chunks = run(go())
    assert chunks[-1].meta_info.finish_reason.type == "abort"
    out = chunks[-1].output_ids
    j = next(len(ch.output_ids) - 1 for ch in chunks if ch.meta_info.weight_version == "mid")
    assert 5 <= j < len(out) - 10
    assert all(ch.meta_info.weight_version != "mid" for ch in chunks if len(ch.output_ids) <= j)
    ref_new = type(hf_model).from_pretrained(model_dir, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for n, t in new.items():
            ref_new.get_parameter(n).copy_(t)
        cache = cache_from_layers([], [])
        kw = cache_kwarg(hf_model)
        hf_model(input_ids=torch.tensor([USER + out[: j - 1]]), use_cache=True, **{kw: cache})
        expected, token = [], out[j - 1]
        for _ in range(10):
            logits = ref_new(input_ids=torch.tensor([[token]]), use_cache=True, **{kw: cache}).logits[0, -1]
            token = int(logits.argmax())
            expected.append(token)
    assert out[:j] == greedy(USER, j)
    assert out[j : j + 10] == expected


@pytest.mark.parametrize(
    ("tensors", "needle"),
    [
        ({"model.no_such.weight": torch.zeros(2, 2)}, "unknown parameter names"),
        ({"model.embed_tokens.weight": torch.zeros(3, 3)}, "shape of model.embed_tokens.weight"),
    ],
)
def test_bad_weight_updates_are_400_and_change_nothing(
    server: Any, greedy: Greedy, tensors: dict[str, Any], needle: str
) -> None:
    payload = base64.b64encode(save(tensors)).decode()

    async def go() -> None:
        async with EngineClient(server.url, timeout_s=60) as c:
            v0 = (await c.model_info()).weight_version
            await c.begin_weight_update()
            with pytest.raises(EngineError, match=needle):
                await c.update_weights_from_tensor([payload], load_format="safetensors")
            with pytest.raises(EngineError, match="never unpickles"):
                await c.update_weights_from_tensor([payload])
            with pytest.raises(EngineError, match="not base64 safetensors"):
                await c.update_weights_from_tensor(["!!!"], load_format="safetensors")
            await c.end_weight_update()
            with pytest.raises(EngineError, match=r"no \*\.safetensors"):
                await c.update_weights_from_disk("/nonexistent")
            assert (await c.model_info()).weight_version == v0
            assert (await c.generate(USER, GREEDY)).output_ids == greedy(USER, 16)

    run(go())


def test_tensor_updates_outside_a_session_are_refused_as_sglang_refuses_them(
    server: Any, hf_model: Any, greedy: Greedy
) -> None:
    """SGLang 0.5.23 loads tensors only between /begin_weight_update and /end_weight_update, and refuses a
    second begin or an end without a begin; gyre-engine answers each with SGLang's status, body shape and
    message (tests/fixtures/sglang-0.5.23: update_tensor_outside_session, begin_weight_update_twice,
    end_weight_update_without_begin)."""
    payload = base64.b64encode(save({k: v.contiguous() for k, v in _perturbed(hf_model, 3).items()})).decode()

    async def go() -> None:
        async with EngineClient(server.url, timeout_s=60) as c:
            v0 = (await c.model_info()).weight_version
            for path, body, fixture in (
                ("/update_weights_from_tensor", {"serialized_named_tensors": [payload], "load_format": "safetensors"},
                 "update_tensor_outside_session"),
                ("/end_weight_update", {}, "end_weight_update_without_begin"),
            ):  # fmt: skip
                r = await c._http.post(path, json=body)
                assert (r.status_code, r.json()) == (400, sglang_fixture(fixture)["body"])
            assert (await c.begin_weight_update()).success
            r = await c._http.post("/begin_weight_update", json={})
            assert (r.status_code, r.json()) == (400, sglang_fixture("begin_weight_update_twice")["body"])
            assert (await c.end_weight_update()).success
            assert (await c.model_info()).weight_version == v0
            assert (await c.generate(USER, GREEDY)).output_ids == greedy(USER, 16)

    run(go())


def test_release_and_resume_memory(server: Any, greedy: Greedy) -> None:
    async def go() -> None:
        async with EngineClient(server.url, timeout_s=60) as c:
            task = asyncio.create_task(c.generate(USER, LONG, rid="busy"))
            while (await c.server_info()).running_requests == 0:
                await asyncio.sleep(0.02)
            with pytest.raises(EngineError, match="idle") as info:
                await c.release_memory()
            assert info.value.status == 409
            await c.abort("busy")
            await task
            await c.release_memory(["weights", "kv_cache"])
            assert (await c.server_info()).released == ["kv_cache", "weights"]
            assert (await c.server_info()).cached_prefix_tokens == 0
            with pytest.raises(EngineError, match="released") as info:
                await c.generate(USER, GREEDY)
            assert info.value.status == 409
            assert not await c.health_generate() and not await c.ready()
            with pytest.raises(EngineError, match="unknown memory tags"):
                await c.resume_memory(["bogus"])
            await c.resume_memory(None)
            assert await c.health_generate()
            assert (await c.generate(USER, GREEDY)).output_ids == greedy(USER, 16)

    run(go())


def test_flush_model_info_health_and_nccl_endpoints(server: Any, model_dir: Path) -> None:
    async def go() -> None:
        async with EngineClient(server.url, timeout_s=60) as c:
            await c.generate(USER, GREEDY)
            assert (await c.server_info()).cached_prefix_tokens > 0
            await c.flush_cache()
            assert (await c.server_info()).cached_prefix_tokens == 0
            info = await c.model_info()
            assert info.model_path == str(model_dir) and info.is_generation
            assert await c.health() and await c.health_generate() and await c.ready()
            with pytest.raises(EngineError, match="'nccl' needs the engine on CUDA"):
                await c.init_weights_update_group("127.0.0.1", 29500, 1, 2, "g")

    run(go())
    assert httpx.post(f"{server.url}/pause_generation", json={"mode": "bogus"}, timeout=10).status_code == 400
