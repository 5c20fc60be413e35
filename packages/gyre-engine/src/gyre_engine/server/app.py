"""The HTTP face of the engine: SGLang's native endpoints as a Starlette app.

Every request passes the gate first (`gate.py`: the bearer token when the server has one, the bounds on
body sizes). Handlers decode bodies with msgspec, hand work to the engine thread through `Engine.call`,
and wait with a timeout; /generate and the health probe live in `generate.py`. Every error is in SGLang's
shape (`errors.py`): bad input is a 400, a request the engine cannot take now (paused, released,
updating) is a 409 marked retryable, an unknown path or method is FastAPI's 404 / 405 as SGLang sends it;
the server keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gyre_engine.protocol import (
    KV_PREFIX_DECODER,
    KV_PREFIX_ENCODER,
    AbortRequest,
    BeginWeightUpdateRequest,
    ContinueRequest,
    ImportPrefixXferRequest,
    Loads,
    LoadSnapshot,
    MemoryRequest,
    ModelInfo,
    OfferPrefixRequest,
    PauseRequest,
    PrefixImportReply,
    ReleaseOfferRequest,
    ServerInfo,
    StatusReply,
    SuccessReply,
    UpdateFromDiskRequest,
    UpdateFromTensorRequest,
    UpdateFromXferRequest,
    XferWeightsReply,
)
from gyre_engine.server.dist_update import (
    DestroyWeightsUpdateGroupRequest,
    InitWeightsUpdateGroupRequest,
    UpdateFromDistributedRequest,
    WeightGroups,
)
from gyre_engine.server.engine import Engine, EngineUnavailable
from gyre_engine.server.errors import (
    error_for,
    error_response,
    http_exception,
    json_response,
    refused,
    unhandled,
)
from gyre_engine.server.gate import BodyLimits, Gate
from gyre_engine.server.generate import GenerateRoutes
from gyre_engine.server.kv_transfer import (
    cached_prefix,
    check_offer_fits,
    export_prefix,
    import_prefix,
    install_prefix,
)
from gyre_engine.server.weights import (
    apply_named_tensors,
    check_complete,
    check_named_tensors,
    decode_safetensors_b64,
    read_model_dir,
)
from gyre_engine.server.xfer import XferConfig, XferHub, block_reports, snapshot_tensors

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class AppConfig:
    model_path: str
    """Shown by /model_info."""
    served_model_name: str | None = None
    control_timeout_s: float = 300.0
    """Longest wait for a control call (weight update, pause, ...) to run on the engine thread."""
    request_timeout_s: float = 3600.0
    """Longest a /generate waits for its next token before it is aborted."""
    health_timeout_s: float = 20.0
    xfer: XferConfig = field(default_factory=XferConfig)
    """Transports for /update_weights_from_xfer and the prefix hand-off endpoints."""
    token: str = ""
    """The bearer token every request but the health probes must carry ("": none; `serve` resolves it
    from its setting or `$GYRE_TOKEN` and refuses a bind beyond loopback without one)."""
    max_body_bytes: int = 16 << 20
    """Longest request body (413 past it) on every path but the two below."""
    max_bulk_body_bytes: int = 4 << 30
    """Longest body of /update_weights_from_tensor and /import_prefix (weights and KV inside HTTP)."""
    sglang_only: bool = False
    """Serve SGLang's endpoints only (`GYRE_ONLY` answer 404, as on SGLang): gyre-engine standing in for
    SGLang, so a client that must work against SGLang is tested without gyre's extras."""


GYRE_ONLY = (
    "/server_info",
    "/export_prefix",
    "/import_prefix",
    "/update_weights_from_xfer",
    "/offer_prefix",
    "/import_prefix_xfer",
    "/release_prefix_offer",
)
"""gyre-engine's own endpoints, which SGLang 0.5.23 does not serve (its /server_info is its configuration)."""


def build_app(engine: Engine, config: AppConfig) -> Starlette:
    """The Starlette app serving `engine`."""
    xfer = XferHub(config.xfer)
    xfer_weights = asyncio.Lock()  # a snapshot's arrays live in the subscriber's staging until applied
    groups = WeightGroups(engine.model, engine.device)  # SGLang's distributed weight-update groups

    gen = GenerateRoutes(engine, config.request_timeout_s, config.control_timeout_s, config.health_timeout_s)

    async def run(fn: Callable[..., T], *args: Any, timeout: float | None = None) -> T:
        fut = engine.call(fn, *args)
        return await asyncio.wait_for(asyncio.wrap_future(fut), timeout or config.control_timeout_s)

    async def body_as(request: Request, typ: type[T]) -> T:
        raw = await request.body()
        return msgspec.json.decode(raw or b"{}", type=typ)

    def guarded(
        handler: Callable[[Request], Awaitable[Response]],
    ) -> Callable[[Request], Awaitable[Response]]:
        async def wrapped(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as exc:
                return error_for(exc)

        return wrapped

    # ------------------------------------------------------------------ control
    async def abort_request(request: Request) -> Response:
        body = await body_as(request, AbortRequest)
        if body.abort_all:
            await run(engine.abort_all)
        elif body.rid:
            await run(engine.abort, body.rid)
        return Response(b"", status_code=200)

    async def pause_generation(request: Request) -> Response:
        body = await body_as(request, PauseRequest)
        n = await run(engine.pause, body.mode)
        return json_response(StatusReply(f"Generation paused ({body.mode}); {n} requests affected"))

    async def continue_generation(request: Request) -> Response:
        body = await body_as(request, ContinueRequest)
        await run(engine.resume_generation)
        if body.torch_empty_cache:
            await run(_empty_device_cache, engine)
        return json_response(StatusReply("Generation continued"))

    async def begin_weight_update(request: Request) -> Response:
        await body_as(request, BeginWeightUpdateRequest)
        if not await run(engine.begin_weight_update):
            return refused("a weight-update session is already open; call end_weight_update() first")
        return json_response(
            SuccessReply(True, "weight update begun; generation holds until end_weight_update")
        )

    async def end_weight_update(request: Request) -> Response:
        version = await run(engine.end_weight_update)
        if version is None:
            return refused("no weight-update session is open; call begin_weight_update() first")
        return json_response(SuccessReply(True, f"weight update ended; weight_version={version}"))

    def outside_session(what: str) -> Response | None:
        """SGLang 0.5.23 loads tensors and distributed updates only inside a weight-update session."""
        if engine.updating:
            return None
        return refused(f"{what} must run between begin_weight_update() and end_weight_update()")

    async def update_from_tensor(request: Request) -> Response:
        body = await body_as(request, UpdateFromTensorRequest)
        if (no := outside_session("update_weights_from_tensor")) is not None:
            return no
        if body.load_format != "safetensors":
            return error_response(
                f"load_format {body.load_format!r} is not accepted: gyre-engine never unpickles; send "
                "load_format='safetensors' with base64 safetensors payloads"
            )
        tensors = decode_safetensors_b64(body.serialized_named_tensors)
        n = await run(
            engine.update_weights,
            lambda: apply_named_tensors(engine.model, tensors),
            body.weight_version,
            body.flush_cache,
            body.abort_all_requests,
        )
        return json_response(
            SuccessReply(True, f"updated {n} tensors; weight_version={engine.weight_version}")
        )

    async def update_from_disk(request: Request) -> Response:
        body = await body_as(request, UpdateFromDiskRequest)
        tensors = await asyncio.to_thread(read_model_dir, body.model_path)
        running, waiting = await run(engine.counts)
        n = await run(
            engine.update_weights,
            lambda: apply_named_tensors(engine.model, tensors),
            body.weight_version,
            body.flush_cache,
            body.abort_all_requests,
        )
        msg = f"updated {n} tensors from {body.model_path}; weight_version={engine.weight_version}"
        return json_response(
            SuccessReply(True, msg, num_paused_requests=0 if body.abort_all_requests else running + waiting)
        )

    async def init_weights_update_group(request: Request) -> Response:
        body = await body_as(request, InitWeightsUpdateGroupRequest)
        g = await groups.init(body)
        msg = f"joined weight update group {g.name!r} as rank {g.rank} of {g.world_size} ({g.backend})"
        return json_response(SuccessReply(True, msg))

    async def update_from_distributed(request: Request) -> Response:
        body = await body_as(request, UpdateFromDistributedRequest)
        if (no := outside_session("update_weights_from_distributed")) is not None:
            return no
        t0 = time.monotonic()
        tensors = await groups.receive(body)
        n = await run(
            engine.update_weights,
            lambda: apply_named_tensors(engine.model, tensors),
            body.weight_version,
            body.flush_cache,
            body.abort_all_requests,
        )
        msg = (
            f"updated {n} tensors from group {body.group_name!r} in {time.monotonic() - t0:.3f} s; "
            f"weight_version={engine.weight_version}"
        )
        return json_response(SuccessReply(True, msg))

    async def destroy_weights_update_group(request: Request) -> Response:
        body = await body_as(request, DestroyWeightsUpdateGroupRequest)
        groups.destroy(body.group_name)
        return json_response(SuccessReply(True, f"weight update group {body.group_name!r} destroyed"))

    async def release_memory(request: Request) -> Response:
        body = await body_as(request, MemoryRequest)
        await run(engine.release_memory, body.tags)
        return json_response(None)

    async def resume_memory(request: Request) -> Response:
        body = await body_as(request, MemoryRequest)
        await run(engine.resume_memory, body.tags)
        return json_response(None)

    async def flush_cache(request: Request) -> Response:
        try:
            await run(engine.flush_cache)
        except EngineUnavailable as exc:
            return Response(str(exc).encode(), status_code=400, media_type="text/plain")
        return Response(b"Cache flushed.\n", status_code=200, media_type="text/plain")

    async def model_info(request: Request) -> Response:
        p = next(engine.model.parameters())
        hf = getattr(engine.model, "config", None)
        return json_response(
            ModelInfo(
                model_path=config.model_path,
                served_model_name=config.served_model_name or config.model_path,
                tokenizer_path=config.model_path,
                is_generation=True,
                weight_version=engine.weight_version,
                load_format="auto",
                disaggregation_mode="null",
                model_type=getattr(hf, "model_type", None),
                architectures=getattr(hf, "architectures", None),
                max_context_length=engine.context_len,
                device=str(engine.device),
                dtype=str(p.dtype).removeprefix("torch."),
            )
        )

    async def loads(request: Request) -> Response:
        """SGLang's GET /v1/loads: one data-parallel rank from the engine's counters. `decode_moments` holds
        decode steps, tokens (the sum of batch sizes), and step microseconds; squared sizes and size x
        microseconds are not tracked (0)."""
        st = engine.stats()
        running, waiting = engine.counts()
        snap = LoadSnapshot(
            timestamp=time.time(),
            num_running_reqs=running,
            num_waiting_reqs=waiting,
            total_prefill_uncached_tokens=st.prefill_tokens_computed,
            decode_moments=[
                float(st.decode_steps),
                float(st.decode_tokens),
                st.decode_time_s * 1e6,
                0.0,
                0.0,
                float(st.decode_tokens),
            ],
        )
        return json_response(Loads([snap], version=None))

    async def server_info(request: Request) -> Response:
        st = engine.stats()
        running, waiting = engine.counts()
        return json_response(
            ServerInfo(
                weight_version=engine.weight_version,
                running_requests=running,
                waiting_requests=waiting,
                paused=engine.paused,
                released=sorted(engine.released),
                prefill_tokens_computed=st.prefill_tokens_computed,
                prefill_tokens_cached=st.prefill_tokens_cached,
                decode_steps=st.decode_steps,
                decode_tokens=st.decode_tokens,
                cached_prefix_tokens=engine.prefix.total_tokens,
                open_prefix_offers=xfer.open_offers,
            )
        )

    async def ready(request: Request) -> Response:
        return Response(b"", status_code=200 if engine.alive and not engine.released else 503)

    async def export_kv(request: Request) -> Response:
        body = await body_as(request, _ExportBody)
        rec = await run(export_prefix, engine, body.input_ids)
        if rec is None:
            return error_response("no cached prefix of these input_ids", 404, "NotFound")
        return Response(KV_PREFIX_ENCODER.encode(rec), media_type="application/msgpack")

    async def import_kv(request: Request) -> Response:
        rec = KV_PREFIX_DECODER.decode(await request.body())
        n = await run(import_prefix, engine, rec)
        return json_response(SuccessReply(True, f"imported a prefix of {n} tokens"))

    # ------------------------------------------------------------------ gyre-xfer

    async def update_from_xfer(request: Request) -> Response:
        body = await body_as(request, UpdateFromXferRequest)
        async with xfer_weights:
            t0 = time.monotonic()
            limit = body.timeout_s + 2 * body.control_timeout_s + 5
            snap = await asyncio.wait_for(asyncio.to_thread(xfer.pull_snapshot, body), limit)
            pull_s = time.monotonic() - t0
            tensors = snapshot_tensors(snap, engine.model, body.layout)
            check_named_tensors(engine.model, tensors)
            check_complete(engine.model, set(tensors))
            version = body.weight_version or str(snap.version)
            t1 = time.monotonic()
            n = await run(
                engine.update_weights,
                lambda: apply_named_tensors(engine.model, tensors),
                version,
                body.flush_cache,
                body.abort_all_requests,
            )
            apply_s = time.monotonic() - t1
        msg = f"loaded snapshot version {snap.version} ({n} tensors) from {body.publisher}"
        return json_response(
            XferWeightsReply(True, msg, engine.weight_version, snap.version, n, snap.nbytes, pull_s, apply_s)
        )

    async def offer_prefix(request: Request) -> Response:
        body = await body_as(request, OfferPrefixRequest)
        got = await run(cached_prefix, engine, body.input_ids)
        if got is None:
            return error_response("no cached prefix of these input_ids", 404, "NotFound")
        offer = await asyncio.to_thread(xfer.offer, body, *got)
        return json_response(offer)

    async def import_prefix_xfer(request: Request) -> Response:
        body = await body_as(request, ImportPrefixXferRequest)
        o = body.offer
        layers = check_offer_fits(engine, o.model_fingerprint, o.weight_version, o.token_ids)
        kv, res = await asyncio.wait_for(
            asyncio.to_thread(xfer.pull_prefix, o, layers, engine.device, body.timeout_s),
            body.timeout_s + 10,
        )
        n = await run(install_prefix, engine, o.token_ids, kv, o.weight_version)
        msg = f"imported a prefix of {n} tokens in {len(res.blocks)} blocks"
        return json_response(PrefixImportReply(True, msg, n, block_reports(res), res.nbytes, res.elapsed_s))

    async def release_prefix_offer(request: Request) -> Response:
        body = await body_as(request, ReleaseOfferRequest)
        if not await asyncio.to_thread(xfer.release, body.offer_id):
            return error_response(f"no open offer {body.offer_id!r} (released or expired)", 404, "NotFound")
        return json_response(SuccessReply(True, f"offer {body.offer_id} released"))

    routes = [
        Route("/generate", guarded(gen.generate), methods=["POST"]),
        Route("/abort_request", guarded(abort_request), methods=["POST"]),
        Route("/pause_generation", guarded(pause_generation), methods=["POST"]),
        Route("/continue_generation", guarded(continue_generation), methods=["POST"]),
        Route("/begin_weight_update", guarded(begin_weight_update), methods=["POST"]),
        Route("/end_weight_update", guarded(end_weight_update), methods=["POST"]),
        Route("/update_weights_from_tensor", guarded(update_from_tensor), methods=["POST"]),
        Route("/update_weights_from_disk", guarded(update_from_disk), methods=["POST"]),
        Route("/init_weights_update_group", guarded(init_weights_update_group), methods=["POST"]),
        Route("/update_weights_from_distributed", guarded(update_from_distributed), methods=["POST"]),
        Route("/destroy_weights_update_group", guarded(destroy_weights_update_group), methods=["POST"]),
        Route("/release_memory_occupation", guarded(release_memory), methods=["POST"]),
        Route("/resume_memory_occupation", guarded(resume_memory), methods=["POST"]),
        Route("/flush_cache", guarded(flush_cache), methods=["GET", "POST"]),
        Route("/model_info", guarded(model_info), methods=["GET"]),
        Route("/get_model_info", guarded(model_info), methods=["GET"]),
        Route("/server_info", guarded(server_info), methods=["GET"]),
        Route("/v1/loads", guarded(loads), methods=["GET"]),
        Route("/health", guarded(gen.health_generate), methods=["GET"]),
        Route("/health_generate", guarded(gen.health_generate), methods=["GET"]),
        Route("/ready", guarded(ready), methods=["GET"]),
        Route("/export_prefix", guarded(export_kv), methods=["POST"]),
        Route("/import_prefix", guarded(import_kv), methods=["POST"]),
        Route("/update_weights_from_xfer", guarded(update_from_xfer), methods=["POST"]),
        Route("/offer_prefix", guarded(offer_prefix), methods=["POST"]),
        Route("/import_prefix_xfer", guarded(import_prefix_xfer), methods=["POST"]),
        Route("/release_prefix_offer", guarded(release_prefix_offer), methods=["POST"]),
    ]
    if config.sglang_only:
        routes = [r for r in routes if r.path not in GYRE_ONLY]
    limits = BodyLimits(config.max_body_bytes, config.max_bulk_body_bytes)
    app = Starlette(
        routes=routes,
        middleware=[Middleware(Gate, token=config.token, limits=limits)],
        exception_handlers={HTTPException: http_exception, Exception: unhandled},
    )
    app.state.xfer = xfer
    app.state.weight_groups = groups
    app.state.generation = gen
    return app


class _ExportBody(msgspec.Struct, frozen=True):
    input_ids: list[int]


def _empty_device_cache(engine: Engine) -> None:
    if engine.device.type == "cuda":
        import torch

        torch.cuda.empty_cache()
