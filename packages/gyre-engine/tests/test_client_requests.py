"""The client sends the structs the server decodes: every request `EngineClient` makes goes over real HTTP
on loopback to a recorder that decodes its body with the server's own code (`routing.body_as` with the
struct the server's route handler names, `parse_generate` for /generate), and the arguments must arrive
under the server's field names, with no key the server would drop. Also: the client's keyword defaults are
the protocol's, and its /generate bodies are the ones SGLang 0.5.23 was recorded accepting."""

from __future__ import annotations

import asyncio
import inspect
import re
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
from gyre_base.testing import AppThread
from gyre_engine import protocol
from gyre_engine.client import EngineClient, handoff_prefix
from gyre_engine.protocol import (
    KV_PREFIX_DECODER,
    KV_PREFIX_ENCODER,
    AbortRequest,
    BeginWeightUpdateRequest,
    ContinueRequest,
    DestroyWeightsUpdateGroupRequest,
    ExportPrefixRequest,
    GenerateRequest,
    ImportPrefixXferRequest,
    InitWeightsUpdateGroupRequest,
    KvPrefix,
    MemoryRequest,
    OfferPrefixRequest,
    PauseRequest,
    PrefixImportReply,
    PrefixOffer,
    ReleaseOfferRequest,
    SamplingParams,
    StatusReply,
    SuccessReply,
    UpdateFromDiskRequest,
    UpdateFromDistributedRequest,
    UpdateFromTensorRequest,
    UpdateFromXferRequest,
    XferWeightsReply,
)

torch = pytest.importorskip("torch")

from gyre_engine.server.control import ControlRoutes  # noqa: E402
from gyre_engine.server.info import InfoRoutes  # noqa: E402
from gyre_engine.server.parse import parse_generate  # noqa: E402
from gyre_engine.server.prefixes import PrefixRoutes  # noqa: E402
from gyre_engine.server.routing import body_as  # noqa: E402
from gyre_engine.server.updates import WeightRoutes  # noqa: E402
from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import Response  # noqa: E402
from starlette.routing import Route  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # the shared helpers (tests run with --import-mode=importlib)
from routes import ROUTES  # noqa: E402
from sglang_shapes import fixture, sse  # noqa: E402

USER = [2100 + i for i in range(7)]
OFFER = PrefixOffer("offer-9", "fp", "v3", USER[:4], "bfloat16", 2, 8, 4, 60.0, msgspec.Raw(b'{"pool":1}'))
KV = KvPrefix(protocol.PROTOCOL_VERSION, "fp", "v3", USER[:2], "float32", (1, 2, 1), [b"\0" * 8], [b"\1" * 8])


def server_decoders() -> dict[str, type]:
    """Path -> the struct the server's handler decodes its body as, read from the route groups' own code
    (`route("/path", self.handler)` in `routes()`, `body_as(request, Struct)` in the handler)."""
    out: dict[str, type] = {}
    for cls in (ControlRoutes, WeightRoutes, PrefixRoutes, InfoRoutes):
        module = sys.modules[cls.__module__]
        for path, name in re.findall(r'route\("([^"]+)", self\.(\w+)', inspect.getsource(cls.routes)):
            decoded = re.search(r"body_as\(request, (\w+)\)", inspect.getsource(getattr(cls, name)))
            if decoded is not None:
                out[path] = getattr(module, decoded.group(1))
    return out


DECODERS = server_decoders()


class Recorder:
    """TEST FIXTURE: a real HTTP server on loopback that decodes each request body with the server's code
    and answers in the shape the server (or, for /generate, SGLang's recording) answers."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, bytes, Any]] = []
        """(path, raw body, what the server's decoder made of it) per request, in order."""
        self.http = AppThread(Starlette(routes=[Route("/{path:path}", self.handle, methods=["POST"])]))
        self.url = self.http.url

    async def handle(self, request: Request) -> Response:
        path = "/" + request.path_params["path"]
        raw = await request.body()
        if path == "/generate":
            req = msgspec.json.decode(raw, type=GenerateRequest)  # as generate.py reads it
            self.seen.append((path, raw, (req, parse_generate(req, lambda s: [], 4096))))
            if req.stream:
                return Response(sse(fixture("stream_default")["events"]), media_type="text/event-stream")
            name = "generate_text" if isinstance(req.input_ids[0], int) else "generate_batch"  # type: ignore[index]
            return _json(fixture(name)["body"])
        if path == "/import_prefix":
            self.seen.append((path, raw, KV_PREFIX_DECODER.decode(raw)))
            return _json(SuccessReply(True, "imported"))
        decoded = await body_as(request, DECODERS[path]) if path in DECODERS else None
        self.seen.append((path, raw, decoded))
        return REPLIES.get(path, lambda: _json(SuccessReply(True, "ok")))()

    def stop(self) -> None:
        self.http.stop()


def _json(obj: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status, media_type="application/json")


REPLIES = {
    "/abort_request": lambda: Response(b""),
    "/pause_generation": lambda: _json(StatusReply("paused")),
    "/continue_generation": lambda: _json(StatusReply("continued")),
    "/release_memory_occupation": lambda: _json(None),
    "/resume_memory_occupation": lambda: _json(None),
    "/flush_cache": lambda: Response(b"Cache flushed.", media_type="text/plain"),
    "/export_prefix": lambda: Response(KV_PREFIX_ENCODER.encode(KV), media_type="application/msgpack"),
    "/offer_prefix": lambda: _json(OFFER),
    "/import_prefix_xfer": lambda: _json(PrefixImportReply(True, "ok", 4, [], 64, 0.01)),
    "/update_weights_from_xfer": lambda: _json(XferWeightsReply(True, "ok", "7", 7, 3, 96, 0.1, 0.01)),
}


@pytest.fixture(scope="module")
def recorded() -> list[tuple[str, bytes, Any]]:
    """Every client call, each with arguments unlike the defaults, recorded once for the module."""
    rec = Recorder()
    sp = SamplingParams(max_new_tokens=9, temperature=0.5, stop=["\n\n"], sampling_seed=3)

    async def calls() -> None:
        async with EngineClient(rec.url, timeout_s=30) as c:
            await c.generate(USER, sp, rid="r-1", return_logprob=True, top_logprobs_num=2)
            await c.generate_batch([USER, USER[:3]], sp, return_logprob=True)
            _ = [chunk async for chunk in c.stream(USER, sp, rid="r-2", return_logprob=True)]
            await c.abort("r-1")
            await c.abort_all()
            await c.pause("retract")
            await c.continue_generation(torch_empty_cache=True)
            await c.begin_weight_update()
            await c.update_weights_from_tensor(
                ["cGF5bG9hZA=="], load_format="safetensors", weight_version="t1"
            )
            await c.end_weight_update()
            await c.update_weights_from_disk("/models/m", weight_version="d1", flush_cache=False)
            await c.init_weights_update_group("10.0.0.2", 29500, 1, 3, "g", "gloo", timeout_s=42.0)
            await c.update_weights_from_distributed(
                ["w"], ["bfloat16"], [[2, 3]], "g", weight_version="n1", abort_all_requests=True
            )
            await c.destroy_weights_update_group("g")
            await c.release_memory(["kv_cache"])
            await c.resume_memory(["kv_cache"])
            await c.flush_cache()
            assert await c.export_prefix(USER) == KV
            await c.import_prefix(KV)
            await c.update_weights_from_xfer(
                "tcp://127.0.0.1:5", min_version=7, transport="mooncake", timeout_s=30.0, layout="megatron"
            )
            assert await handoff_prefix(c, c, USER, transport="mooncake", timeout_s=12.0, block_tokens=4)

    try:
        asyncio.run(calls())
    finally:
        rec.stop()
    return rec.seen


def _one(seen: list[tuple[str, bytes, Any]], path: str) -> list[Any]:
    return [decoded for p, _, decoded in seen if p == path]


def test_every_route_with_a_body_is_read_from_the_server_and_exercised(
    recorded: list[tuple[str, bytes, Any]],
) -> None:
    """The decoders found in the route groups' code cover every POST route but /generate (its own
    reader) and /import_prefix (msgpack); the client calls every one of them but /get_weights_by_name,
    a debugging endpoint it does not offer."""
    posted = {path for path, methods in ROUTES if "POST" in methods}
    bodiless = {"/end_weight_update", "/flush_cache"}  # the server reads no body (the client sends {})
    assert set(DECODERS) == posted - bodiless - {"/generate", "/import_prefix"}
    assert {p for p, _, _ in recorded} == posted - {"/get_weights_by_name"}


def test_no_key_the_server_would_drop(recorded: list[tuple[str, bytes, Any]]) -> None:
    """Each body's keys are fields of the struct the server decodes it as (a struct that does not forbid
    unknown fields would silently drop a renamed one)."""
    for path, raw, _ in recorded:
        struct = GenerateRequest if path == "/generate" else DECODERS.get(path)
        if struct is None:
            continue
        keys = set(msgspec.json.decode(raw or b"{}"))
        assert keys <= set(struct.__struct_fields__), (path, keys - set(struct.__struct_fields__))


def test_control_requests_arrive_as_sent(recorded: list[tuple[str, bytes, Any]]) -> None:
    assert _one(recorded, "/abort_request") == [AbortRequest(rid="r-1"), AbortRequest(abort_all=True)]
    assert _one(recorded, "/pause_generation") == [PauseRequest("retract")]
    assert _one(recorded, "/continue_generation") == [ContinueRequest(torch_empty_cache=True)]
    assert _one(recorded, "/begin_weight_update") == [BeginWeightUpdateRequest()]
    assert _one(recorded, "/release_memory_occupation") == [MemoryRequest(["kv_cache"])]
    assert _one(recorded, "/resume_memory_occupation") == [MemoryRequest(["kv_cache"])]
    assert [raw for p, raw, _ in recorded if p in ("/end_weight_update", "/flush_cache")] == [b"{}", b"{}"]


def test_weight_updates_arrive_as_sent(recorded: list[tuple[str, bytes, Any]]) -> None:
    assert _one(recorded, "/update_weights_from_tensor") == [
        UpdateFromTensorRequest(["cGF5bG9hZA=="], load_format="safetensors", weight_version="t1")
    ]
    assert _one(recorded, "/update_weights_from_disk") == [
        UpdateFromDiskRequest("/models/m", weight_version="d1", flush_cache=False)
    ]
    assert _one(recorded, "/init_weights_update_group") == [
        InitWeightsUpdateGroupRequest("10.0.0.2", 29500, 1, 3, "g", "gloo", timeout_s=42.0)
    ]
    assert _one(recorded, "/update_weights_from_distributed") == [
        UpdateFromDistributedRequest(
            ["w"], ["bfloat16"], [[2, 3]], "g", weight_version="n1", abort_all_requests=True
        )
    ]
    assert _one(recorded, "/destroy_weights_update_group") == [DestroyWeightsUpdateGroupRequest("g")]
    assert _one(recorded, "/update_weights_from_xfer") == [
        UpdateFromXferRequest(
            "tcp://127.0.0.1:5", min_version=7, transport="mooncake", timeout_s=30.0, layout="megatron"
        )
    ]


def test_prefix_hand_off_arrives_as_sent(recorded: list[tuple[str, bytes, Any]]) -> None:
    assert _one(recorded, "/export_prefix") == [ExportPrefixRequest(USER)]
    assert _one(recorded, "/import_prefix") == [KV]
    assert _one(recorded, "/offer_prefix") == [OfferPrefixRequest(USER, transport="mooncake", block_tokens=4)]
    assert _one(recorded, "/import_prefix_xfer") == [ImportPrefixXferRequest(OFFER, timeout_s=12.0)]
    assert _one(recorded, "/release_prefix_offer") == [ReleaseOfferRequest("offer-9", arrived=[])]


def test_generate_requests_parse_as_the_server_parses_them(recorded: list[tuple[str, bytes, Any]]) -> None:
    (one, single), (batch, rows), (stream, streamed) = _one(recorded, "/generate")
    (first,) = single
    assert (first.rid, first.input_ids, first.return_logprob, first.top_logprobs_num) == (
        "r-1",
        USER,
        True,
        2,
    )
    assert (first.params.max_new_tokens, first.params.temperature, first.params.stop) == (9, 0.5, ["\n\n"])
    assert first.params.sampling_seed == 3
    assert [r.input_ids for r in rows] == [USER, USER[:3]] and all(r.return_logprob for r in rows)
    assert stream.stream and streamed[0].rid == "r-2" and not one.stream and not batch.stream


def test_generate_bodies_are_the_ones_sglang_was_recorded_accepting() -> None:
    """The client's /generate body for the arguments of a recorded SGLang request is that request's body,
    key for key (the recordings: sglang 0.5.23's own HTTP layer answered them 200)."""
    rec = fixture("stream_default")
    assert rec["status"] == 200
    body = EngineClient.generate_request(
        rec["request"]["body"]["input_ids"],
        SamplingParams(max_new_tokens=64),
        return_logprob=True,
        stream=True,
    )
    assert msgspec.json.decode(msgspec.json.encode(body)) == rec["request"]["body"]


def test_the_clients_keyword_defaults_are_the_protocols() -> None:
    """A keyword default of a client method that names a field of the request it sends is that field's
    default (shared memory for the gyre-xfer transports, as the server has it)."""
    sends = {
        EngineClient.update_weights_from_tensor: UpdateFromTensorRequest,
        EngineClient.update_weights_from_disk: UpdateFromDiskRequest,
        EngineClient.init_weights_update_group: InitWeightsUpdateGroupRequest,
        EngineClient.update_weights_from_distributed: UpdateFromDistributedRequest,
        EngineClient.update_weights_from_xfer: UpdateFromXferRequest,
        EngineClient.offer_prefix: OfferPrefixRequest,
        EngineClient.import_prefix_xfer: ImportPrefixXferRequest,
        EngineClient.pause: PauseRequest,
        EngineClient.continue_generation: ContinueRequest,
        handoff_prefix: OfferPrefixRequest,
    }
    checked = 0
    for method, struct in sends.items():
        defaults = dict(
            zip(
                struct.__struct_fields__[-len(struct.__struct_defaults__) :],
                struct.__struct_defaults__,
                strict=True,
            )
        )
        for name, param in inspect.signature(method).parameters.items():
            if (
                name in defaults
                and param.default is not inspect.Parameter.empty
                and param.default is not None
            ):
                assert param.default == defaults[name], (method.__name__, name)
                checked += 1
    assert checked >= 15
    assert inspect.signature(EngineClient.update_weights_from_xfer).parameters["transport"].default == "shm"
    assert inspect.signature(handoff_prefix).parameters["transport"].default == "shm"
