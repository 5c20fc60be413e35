"""`/init_weights_update_group`, `/update_weights_from_distributed`, `/destroy_weights_update_group` on a
real `gyre-engine serve` process, with this test process as the trainer's rank 0 (`WeightGroup`, gloo on
loopback): the endpoints' own checks, independent of gyre-train (whose tests drive them from a core)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from gyre_engine.client import EngineClient, EngineError
from gyre_engine.protocol import SamplingParams
from gyre_engine.weight_group import WeightGroup, bind_master

torch = pytest.importorskip("torch")

USER = [1200 + i * 7 for i in range(9)]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def form(url: str, name: str, timeout_s: float = 30.0) -> WeightGroup:
    """Rank 0 of a two-rank group with the engine at rank 1."""
    listener = bind_master("127.0.0.1")
    port = listener.getsockname()[1]
    reply: dict[str, Any] = {}

    async def join() -> None:
        async with EngineClient(url, timeout_s=60) as c:
            reply["r"] = await c.init_weights_update_group(
                "127.0.0.1", port, 1, 2, name, "gloo", timeout_s=timeout_s
            )

    th = threading.Thread(target=lambda: run(join()))
    th.start()
    group = WeightGroup.form("127.0.0.1", port, 0, 2, name, "gloo", timeout_s, listener=listener)
    th.join()
    assert reply["r"].success and "rank 1 of 2" in reply["r"].message
    return group


def send(url: str, group: WeightGroup, tensors: dict[str, torch.Tensor], body: dict[str, Any]) -> Any:
    """POST the update inside a weight-update session and broadcast `tensors` in order, as a trainer
    does (SGLang 0.5.23 loads only inside a session); the reply or EngineError."""
    out: dict[str, Any] = {}

    async def post() -> None:
        async with EngineClient(url, timeout_s=60) as c:
            await c.begin_weight_update()
            try:
                out["r"] = await c._post("/update_weights_from_distributed", body)
            except EngineError as exc:
                out["r"] = exc
            finally:
                await c.end_weight_update()

    th = threading.Thread(target=lambda: run(post()))
    th.start()
    for name, t in tensors.items():
        group.broadcast(t.contiguous(), name)
    th.join()
    return out["r"]


def body_of(tensors: dict[str, torch.Tensor], group: str, **kw: Any) -> dict[str, Any]:
    return {
        "names": list(tensors),
        "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
        "shapes": [list(t.shape) for t in tensors.values()],
        "group_name": group,
        **kw,
    }


def test_distributed_update(
    spawn_server: Callable[..., Any], hf_model: Any, model_dir: Path, greedy: Any
) -> None:
    srv = spawn_server()
    url = srv.url
    group = form(url, "g")
    torch.manual_seed(3)
    other = {n: torch.randn_like(p) * 0.5 for n, p in hf_model.named_parameters()}

    async def info() -> tuple[list[int], str]:
        async with EngineClient(url, timeout_s=60) as c:
            r = await c.generate(USER, GREEDY)
            return list(r.output_ids), r.meta_info.weight_version

    async def refusals() -> None:
        async with EngineClient(url, timeout_s=60) as c:
            with pytest.raises(EngineError, match="exists; destroy it first"):
                await c.init_weights_update_group("127.0.0.1", 1, 1, 2, "g", "gloo")
            with pytest.raises(EngineError, match="rank_offset 0 must be in"):
                await c.init_weights_update_group("127.0.0.1", 1, 0, 2, "h", "gloo")
            # outside a session SGLang refuses at once (nothing is received), with this reply
            with pytest.raises(EngineError, match=r"must run between begin_weight_update\(\) and") as err:
                await c.update_weights_from_distributed(["a"], ["float32"], [[1]], "g")
            assert err.value.status == 400
            # malformed requests are refused before any broadcast is consumed
            await c.begin_weight_update()
            with pytest.raises(EngineError, match="differ in length"):
                await c.update_weights_from_distributed(["a", "b"], ["float32"], [[1]], "g")
            with pytest.raises(EngineError, match=r"'torch\.float32' is not a torch dtype name"):
                await c.update_weights_from_distributed(["a"], ["torch.float32"], [[1]], "g")
            with pytest.raises(EngineError, match="no weight update group 'nope'"):
                await c.update_weights_from_distributed(["a"], ["float32"], [[1]], "nope")
            await c.end_weight_update()
            with pytest.raises(EngineError, match="no weight update group 'nope'"):
                await c.destroy_weights_update_group("nope")

    run(refusals())
    assert run(info()) == (greedy(USER, 8), "0")
    # integer data for a floating parameter: received (the group stays in step), then refused
    bad = {**other, "model.norm.weight": torch.zeros(other["model.norm.weight"].shape, dtype=torch.int32)}
    r = send(url, group, bad, body_of(bad, "g"))
    assert isinstance(r, EngineError) and r.status == 400
    assert "dtype of model.norm.weight is torch.int32" in r.message and "nothing changed" in r.message
    assert run(info()) == (greedy(USER, 8), "0")
    # the whole model, bf16 on the wire, into the float32 engine: its greedy output becomes transformers'
    wire = {n: t.to(torch.bfloat16) for n, t in other.items()}
    r = send(url, group, wire, body_of(wire, "g", weight_version="v-other"))
    assert not isinstance(r, EngineError), r
    ref = type(hf_model).from_pretrained(model_dir, attn_implementation="sdpa").eval()
    ref.load_state_dict({n: t.float() for n, t in wire.items()}, strict=False)
    with torch.no_grad():
        out = ref.generate(
            torch.tensor([USER]), attention_mask=torch.ones(1, len(USER), dtype=torch.long),
            max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    assert run(info()) == (out[0, len(USER) :].tolist(), "v-other")
    # back to the original weights, without a label: the version is bumped
    orig = dict(hf_model.named_parameters())
    r = send(url, group, {n: orig[n].detach() for n in orig}, body_of(orig, "g"))
    assert not isinstance(r, EngineError), r
    assert run(info()) == (greedy(USER, 8), "v-other+1")

    async def destroy() -> None:
        async with EngineClient(url, timeout_s=60) as c:
            assert (await c.destroy_weights_update_group("g")).success
            await c.begin_weight_update()
            with pytest.raises(EngineError, match="no weight update group 'g'"):
                await c.update_weights_from_distributed(["a"], ["float32"], [[1]], "g")
            await c.end_weight_update()

    run(destroy())
    group.close()
    assert run(info()) == (greedy(USER, 8), "v-other+1")
