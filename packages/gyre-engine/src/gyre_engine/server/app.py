"""The HTTP face of the engine: SGLang's native endpoints as a Starlette app.

Handlers decode bodies with msgspec, hand work to the engine thread through `Engine.call`, and wait with
a timeout. Bad input is a 400 with an SGLang-shaped error (`{"error": {"message", ...}}`); a request the
engine cannot take now (paused, released, updating) is a 409 marked retryable; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from gyre_xfer.errors import XferError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from gyre_engine.protocol import (
    KV_PREFIX_DECODER,
    KV_PREFIX_ENCODER,
    AbortRequest,
    BeginWeightUpdateRequest,
    ContinueRequest,
    ErrorBody,
    ErrorReply,
    GenerateRequest,
    GenerateResponse,
    ImportPrefixXferRequest,
    Loads,
    LoadSnapshot,
    MemoryRequest,
    ModelInfo,
    OfferPrefixRequest,
    PauseRequest,
    PrefixImportReply,
    ProtocolError,
    ReleaseOfferRequest,
    SamplingParams,
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
    DistUpdateError,
    GroupBusy,
    InitWeightsUpdateGroupRequest,
    UpdateFromDistributedRequest,
    WeightGroups,
)
from gyre_engine.server.engine import Engine, EngineUnavailable
from gyre_engine.server.kv_transfer import (
    KvTransferError,
    cached_prefix,
    check_offer_fits,
    export_prefix,
    import_prefix,
    install_prefix,
)
from gyre_engine.server.parse import is_single, parse_generate
from gyre_engine.server.request import EngineRequest, TokenEvent
from gyre_engine.server.response import ResponseBuilder
from gyre_engine.server.weights import (
    WeightUpdateError,
    apply_named_tensors,
    check_complete,
    check_named_tensors,
    decode_safetensors_b64,
    read_model_dir,
)
from gyre_engine.server.xfer import (
    KvPullError,
    XferConfig,
    XferHub,
    block_reports,
    snapshot_tensors,
    xfer_status,
)
from gyre_engine.weight_group import WeightGroupError, WeightGroupTimeout

log = logging.getLogger(__name__)
T = TypeVar("T")
_json = msgspec.json.Encoder()


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


def _json_response(obj: Any, status: int = 200) -> Response:
    return Response(_json.encode(obj), status_code=status, media_type="application/json")


def error_response(
    message: str, status: int = 400, err_type: str = "BadRequestError", retryable: bool = False
) -> Response:
    return _json_response(ErrorReply(ErrorBody(message, err_type, status, retryable)), status)


def refused(message: str) -> Response:
    """A control call SGLang refuses answers 400 `{"success": false, "message"}`."""
    return _json_response(SuccessReply(False, message), 400)


def _error_for(exc: Exception) -> Response:
    if isinstance(exc, KvPullError):
        return error_response(str(exc), exc.status, "KvTransferFailed", retryable=True)
    if isinstance(exc, XferError):
        status, err_type, retry = xfer_status(exc)
        return error_response(f"{err_type}: {exc}", status, err_type, retryable=retry)
    if isinstance(exc, EngineUnavailable):
        return error_response(str(exc), 409, "EngineUnavailable", retryable=True)
    if isinstance(exc, GroupBusy):
        return error_response(str(exc), 409, "WeightGroupBusy", retryable=True)
    if isinstance(exc, WeightGroupTimeout):
        return error_response(str(exc), 504, "WeightGroupTimeout", retryable=True)
    if isinstance(exc, WeightGroupError):
        return error_response(str(exc), 502, "WeightGroupError", retryable=True)
    if isinstance(
        exc,
        ProtocolError
        | WeightUpdateError
        | KvTransferError
        | DistUpdateError
        | msgspec.ValidationError
        | msgspec.DecodeError,
    ):
        return error_response(str(exc))
    if isinstance(exc, TimeoutError):
        return error_response(f"timed out: {exc}", 504, "Timeout", retryable=True)
    log.exception("internal error", exc_info=exc)
    return error_response(f"internal error: {exc!r}", 500, "InternalServerError")


def build_app(engine: Engine, config: AppConfig) -> Starlette:
    """The Starlette app serving `engine`."""
    tok = engine.tokenizer
    xfer = XferHub(config.xfer)
    xfer_weights = asyncio.Lock()  # a snapshot's arrays live in the subscriber's staging until applied
    groups = WeightGroups(engine.model, engine.device)  # SGLang's distributed weight-update groups

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
                return _error_for(exc)

        return wrapped

    # ------------------------------------------------------------------ generate
    async def start(er: EngineRequest) -> asyncio.Queue[TokenEvent]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[TokenEvent] = asyncio.Queue()

        def sink(ev: TokenEvent) -> None:
            loop.call_soon_threadsafe(q.put_nowait, ev)

        fut = engine.submit(er, sink)
        await asyncio.wait_for(asyncio.wrap_future(fut), config.control_timeout_s)
        return q

    async def events(er: EngineRequest, q: asyncio.Queue[TokenEvent]) -> AsyncIterator[TokenEvent]:
        finished = False
        try:
            while not finished:
                ev = await asyncio.wait_for(q.get(), config.request_timeout_s)
                finished = ev.finish is not None
                yield ev
        finally:
            if not finished:  # client went away or timed out: free the engine's row
                engine.call(engine.abort, er.rid, "client disconnected")

    async def complete(er: EngineRequest) -> GenerateResponse:
        q = await start(er)
        rb = ResponseBuilder(er, tok)
        async for ev in events(er, q):
            rb.add(ev)
        return rb.response()

    def tokenize(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"])

    async def generate(request: Request) -> Response:
        req = await body_as(request, GenerateRequest)
        ers = parse_generate(req, tokenize, engine.context_len)
        for er in ers:
            engine.check_request(er)
        if req.stream:
            er = ers[0]
            q = await start(er)

            async def sse() -> AsyncIterator[bytes]:
                rb = ResponseBuilder(er, tok)
                try:
                    async for ev in events(er, q):
                        rb.add(ev)
                        if rb.chunk_due():
                            yield b"data: " + _json.encode(rb.response()) + b"\n\n"
                except Exception as exc:  # the stream already started: report in-band, SGLang-style
                    body = ErrorBody(str(exc), type(exc).__name__, 500, retryable=True)
                    yield b"data: " + _json.encode({"error": body}) + b"\n\n"
                yield b"data: [DONE]\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream")
        results = await asyncio.gather(*(complete(er) for er in ers))
        return _json_response(results[0] if is_single(req) else results)

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
        return _json_response(StatusReply(f"Generation paused ({body.mode}); {n} requests affected"))

    async def continue_generation(request: Request) -> Response:
        body = await body_as(request, ContinueRequest)
        await run(engine.resume_generation)
        if body.torch_empty_cache:
            await run(_empty_device_cache, engine)
        return _json_response(StatusReply("Generation continued"))

    async def begin_weight_update(request: Request) -> Response:
        await body_as(request, BeginWeightUpdateRequest)
        if not await run(engine.begin_weight_update):
            return refused("a weight-update session is already open; call end_weight_update() first")
        return _json_response(
            SuccessReply(True, "weight update begun; generation holds until end_weight_update")
        )

    async def end_weight_update(request: Request) -> Response:
        version = await run(engine.end_weight_update)
        if version is None:
            return refused("no weight-update session is open; call begin_weight_update() first")
        return _json_response(SuccessReply(True, f"weight update ended; weight_version={version}"))

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
        return _json_response(
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
        return _json_response(
            SuccessReply(True, msg, num_paused_requests=0 if body.abort_all_requests else running + waiting)
        )

    async def init_weights_update_group(request: Request) -> Response:
        body = await body_as(request, InitWeightsUpdateGroupRequest)
        g = await groups.init(body)
        msg = f"joined weight update group {g.name!r} as rank {g.rank} of {g.world_size} ({g.backend})"
        return _json_response(SuccessReply(True, msg))

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
        return _json_response(SuccessReply(True, msg))

    async def destroy_weights_update_group(request: Request) -> Response:
        body = await body_as(request, DestroyWeightsUpdateGroupRequest)
        groups.destroy(body.group_name)
        return _json_response(SuccessReply(True, f"weight update group {body.group_name!r} destroyed"))

    async def release_memory(request: Request) -> Response:
        body = await body_as(request, MemoryRequest)
        await run(engine.release_memory, body.tags)
        return _json_response(None)

    async def resume_memory(request: Request) -> Response:
        body = await body_as(request, MemoryRequest)
        await run(engine.resume_memory, body.tags)
        return _json_response(None)

    async def flush_cache(request: Request) -> Response:
        try:
            await run(engine.flush_cache)
        except EngineUnavailable as exc:
            return Response(str(exc).encode(), status_code=400, media_type="text/plain")
        return Response(b"Cache flushed.\n", status_code=200, media_type="text/plain")

    async def model_info(request: Request) -> Response:
        p = next(engine.model.parameters())
        hf = getattr(engine.model, "config", None)
        return _json_response(
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
        return _json_response(Loads([snap], version=None))

    async def server_info(request: Request) -> Response:
        st = engine.stats()
        running, waiting = engine.counts()
        return _json_response(
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

    async def health_generate(request: Request) -> Response:
        if not engine.alive or engine.released or engine.paused or engine.updating:
            return Response(b"", status_code=503)
        er = EngineRequest(
            f"HEALTH_CHECK_{uuid.uuid4().hex}", [0], SamplingParams(max_new_tokens=1, temperature=0.0)
        )
        try:
            resp = await asyncio.wait_for(complete(er), config.health_timeout_s)
        except Exception:
            return Response(b"", status_code=503)
        ok = resp.meta_info.finish_reason is not None and resp.meta_info.finish_reason.type != "abort"
        return Response(b"", status_code=200 if ok else 503)

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
        return _json_response(SuccessReply(True, f"imported a prefix of {n} tokens"))

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
        return _json_response(
            XferWeightsReply(True, msg, engine.weight_version, snap.version, n, snap.nbytes, pull_s, apply_s)
        )

    async def offer_prefix(request: Request) -> Response:
        body = await body_as(request, OfferPrefixRequest)
        got = await run(cached_prefix, engine, body.input_ids)
        if got is None:
            return error_response("no cached prefix of these input_ids", 404, "NotFound")
        offer = await asyncio.to_thread(xfer.offer, body, *got)
        return _json_response(offer)

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
        return _json_response(PrefixImportReply(True, msg, n, block_reports(res), res.nbytes, res.elapsed_s))

    async def release_prefix_offer(request: Request) -> Response:
        body = await body_as(request, ReleaseOfferRequest)
        if not await asyncio.to_thread(xfer.release, body.offer_id):
            return error_response(f"no open offer {body.offer_id!r} (released or expired)", 404, "NotFound")
        return _json_response(SuccessReply(True, f"offer {body.offer_id} released"))

    routes = [
        Route("/generate", guarded(generate), methods=["POST"]),
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
        Route("/health", guarded(health_generate), methods=["GET"]),
        Route("/health_generate", guarded(health_generate), methods=["GET"]),
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
    app = Starlette(routes=routes)
    app.state.xfer = xfer
    app.state.weight_groups = groups
    return app


class _ExportBody(msgspec.Struct, frozen=True):
    input_ids: list[int]


def _empty_device_cache(engine: Engine) -> None:
    if engine.device.type == "cuda":
        import torch

        torch.cuda.empty_cache()
