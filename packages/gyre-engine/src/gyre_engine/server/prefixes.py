"""An agent's cached prefix handed from one engine to another, so the second continues it without
re-prefill: in the body of an HTTP call (`/export_prefix`, `/import_prefix`: a msgpack `KvPrefix`), or
through gyre-xfer (`/offer_prefix` copies the KV into a registered pool, the target's
`/import_prefix_xfer` pulls every block and installs the prefix only if all arrived, and
`/release_prefix_offer` frees the pool). A prefix of another model or weight version is refused.
An offer with transport "cuda_ipc" from an engine on a GPU is made on the engine thread (`XferHub.
offer_on_device`); from an engine elsewhere, or one whose GPU would keep less free than its
`min_free_bytes` with the device copy made, it is an offer over shared memory.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gyre_engine.protocol import (
    KV_PREFIX_DECODER,
    KV_PREFIX_ENCODER,
    ExportPrefixRequest,
    ImportPrefixXferRequest,
    OfferPrefixRequest,
    PrefixImportReply,
    PrefixOffer,
    ReleaseOfferRequest,
    SuccessReply,
)
from gyre_engine.server.engine import Engine
from gyre_engine.server.errors import error_response, json_response
from gyre_engine.server.kv_transfer import (
    cached_prefix,
    check_offer_fits,
    export_prefix,
    import_prefix,
    install_prefix,
)
from gyre_engine.server.routing import EngineCalls, body_as, route
from gyre_engine.server.xfer import NoDeviceRoom, XferHub, block_reports, offer_transport

log = logging.getLogger(__name__)


class PrefixRoutes:
    """The prefix hand-off endpoints over one engine and its gyre-xfer hub."""

    def __init__(self, engine: Engine, call: EngineCalls, xfer: XferHub) -> None:
        self.engine = engine
        self.call = call
        self.xfer = xfer

    def routes(self) -> list[Route]:
        return [
            route("/export_prefix", self.export_kv, "POST"),
            route("/import_prefix", self.import_kv, "POST"),
            route("/offer_prefix", self.offer_prefix, "POST"),
            route("/import_prefix_xfer", self.import_prefix_xfer, "POST"),
            route("/release_prefix_offer", self.release_prefix_offer, "POST"),
        ]

    async def export_kv(self, request: Request) -> Response:
        body = await body_as(request, ExportPrefixRequest)
        rec = await self.call(export_prefix, self.engine, body.input_ids)
        if rec is None:
            return error_response("no cached prefix of these input_ids", 404, "NotFound")
        return Response(KV_PREFIX_ENCODER.encode(rec), media_type="application/msgpack")

    async def import_kv(self, request: Request) -> Response:
        rec = KV_PREFIX_DECODER.decode(await request.body())
        n = await self.call(import_prefix, self.engine, rec)
        return json_response(SuccessReply(True, f"imported a prefix of {n} tokens"))

    async def offer_prefix(self, request: Request) -> Response:
        body = await body_as(request, OfferPrefixRequest)
        offer: PrefixOffer | None = None
        on_device = body.transport == "cuda_ipc" and self.engine.device.type == "cuda"
        if on_device:
            try:
                offer = await self.call(self._offer_on_device, body)
            except NoDeviceRoom as exc:
                log.info("prefix offered over shared memory: %s", exc)
                on_device = False
        if not on_device:
            if body.transport == "cuda_ipc":  # no device memory to share (or to spare): shared memory
                body = msgspec.structs.replace(body, transport="shm")
            got = await self.call(cached_prefix, self.engine, body.input_ids)
            offer = None if got is None else await asyncio.to_thread(self.xfer.offer, body, *got)
        if offer is None:
            return error_response("no cached prefix of these input_ids", 404, "NotFound")
        return json_response(offer)

    def _offer_on_device(self, body: OfferPrefixRequest) -> PrefixOffer | None:
        """On the engine thread: the cached prefix copied into a device buffer shared over CUDA IPC."""
        got = cached_prefix(self.engine, body.input_ids)
        if got is not None and got[1].keys[0].device.type != "cuda":
            raise NoDeviceRoom("the cached prefix is in the host tier")  # offered over shared memory
        keep = self.engine.config.min_free_bytes
        return None if got is None else self.xfer.offer_on_device(body, *got, keep_free_bytes=keep)

    async def import_prefix_xfer(self, request: Request) -> Response:
        body = await body_as(request, ImportPrefixXferRequest)
        o = body.offer
        engine = self.engine
        layers = check_offer_fits(engine, o.model_fingerprint, o.weight_version, o.token_ids)
        kv, res = await asyncio.wait_for(
            asyncio.to_thread(self.xfer.pull_prefix, o, layers, engine.device, body.timeout_s),
            body.timeout_s + 10,
        )
        n = await self.call(install_prefix, engine, o.token_ids, kv, o.weight_version)
        how = offer_transport(o)
        msg = f"imported a prefix of {n} tokens in {len(res.blocks)} blocks over {how}"
        reply = PrefixImportReply(True, msg, n, block_reports(res), res.nbytes, res.elapsed_s, how)
        return json_response(reply)

    async def release_prefix_offer(self, request: Request) -> Response:
        body = await body_as(request, ReleaseOfferRequest)
        if not await asyncio.to_thread(self.xfer.release, body.offer_id, body.arrived):
            return error_response(f"no open offer {body.offer_id!r} (released or expired)", 404, "NotFound")
        return json_response(SuccessReply(True, f"offer {body.offer_id} released"))
