"""Weight updates, each applied on the engine thread between two decode steps and all-or-nothing: from
safetensors in the body, from a model directory, by broadcast from a trainer's group (SGLang's
distributed update), or pulled from a gyre-xfer publisher; plus SGLang's weight-update session
(`/begin_weight_update` ... `/end_weight_update`), which tensor and distributed updates must run inside.
"""

from __future__ import annotations

import asyncio
import time

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gyre_engine.protocol import (
    BeginWeightUpdateRequest,
    DestroyWeightsUpdateGroupRequest,
    InitWeightsUpdateGroupRequest,
    SuccessReply,
    UpdateFromDiskRequest,
    UpdateFromDistributedRequest,
    UpdateFromTensorRequest,
    UpdateFromXferRequest,
    XferWeightsReply,
)
from gyre_engine.server.dist_update import WeightGroups
from gyre_engine.server.engine import Engine
from gyre_engine.server.errors import error_response, json_response, refused
from gyre_engine.server.routing import EngineCalls, body_as, route
from gyre_engine.server.weights import (
    apply_named_tensors,
    check_complete,
    check_named_tensors,
    decode_safetensors_b64,
    read_model_dir,
)
from gyre_engine.server.xfer import XferHub, snapshot_tensors


class WeightRoutes:
    """The weight-update endpoints over one engine, its distributed weight-update groups and its
    gyre-xfer hub."""

    def __init__(self, engine: Engine, call: EngineCalls, groups: WeightGroups, xfer: XferHub) -> None:
        self.engine = engine
        self.call = call
        self.groups = groups
        self.xfer = xfer
        self._xfer_weights = (
            asyncio.Lock()
        )  # a snapshot's arrays live in the subscriber's staging until applied

    def routes(self) -> list[Route]:
        return [
            route("/begin_weight_update", self.begin_weight_update, "POST"),
            route("/end_weight_update", self.end_weight_update, "POST"),
            route("/update_weights_from_tensor", self.update_from_tensor, "POST"),
            route("/update_weights_from_disk", self.update_from_disk, "POST"),
            route("/init_weights_update_group", self.init_weights_update_group, "POST"),
            route("/update_weights_from_distributed", self.update_from_distributed, "POST"),
            route("/destroy_weights_update_group", self.destroy_weights_update_group, "POST"),
            route("/update_weights_from_xfer", self.update_from_xfer, "POST"),
        ]

    # ------------------------------------------------------------------ session
    async def begin_weight_update(self, request: Request) -> Response:
        await body_as(request, BeginWeightUpdateRequest)
        if not await self.call(self.engine.begin_weight_update):
            return refused("a weight-update session is already open; call end_weight_update() first")
        return json_response(
            SuccessReply(True, "weight update begun; generation holds until end_weight_update")
        )

    async def end_weight_update(self, request: Request) -> Response:
        version = await self.call(self.engine.end_weight_update)
        if version is None:
            return refused("no weight-update session is open; call begin_weight_update() first")
        return json_response(SuccessReply(True, f"weight update ended; weight_version={version}"))

    def _outside_session(self, what: str) -> Response | None:
        """SGLang 0.5.23 loads tensors and distributed updates only inside a weight-update session."""
        if self.engine.updating:
            return None
        return refused(f"{what} must run between begin_weight_update() and end_weight_update()")

    # ------------------------------------------------------------------ updates
    async def update_from_tensor(self, request: Request) -> Response:
        body = await body_as(request, UpdateFromTensorRequest)
        if (no := self._outside_session("update_weights_from_tensor")) is not None:
            return no
        if body.load_format != "safetensors":
            return error_response(
                f"load_format {body.load_format!r} is not accepted: gyre-engine never unpickles; send "
                "load_format='safetensors' with base64 safetensors payloads"
            )
        tensors = decode_safetensors_b64(body.serialized_named_tensors)
        engine = self.engine
        n = await self.call(
            engine.update_weights,
            lambda: apply_named_tensors(engine.model, tensors),
            body.weight_version,
            body.flush_cache,
            body.abort_all_requests,
        )
        return json_response(
            SuccessReply(True, f"updated {n} tensors; weight_version={engine.weight_version}")
        )

    async def update_from_disk(self, request: Request) -> Response:
        body = await body_as(request, UpdateFromDiskRequest)
        engine = self.engine
        tensors = await asyncio.to_thread(read_model_dir, body.model_path)
        running, waiting = await self.call(engine.counts)
        n = await self.call(
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

    async def init_weights_update_group(self, request: Request) -> Response:
        body = await body_as(request, InitWeightsUpdateGroupRequest)
        g = await self.groups.init(body)
        msg = f"joined weight update group {g.name!r} as rank {g.rank} of {g.world_size} ({g.backend})"
        return json_response(SuccessReply(True, msg))

    async def update_from_distributed(self, request: Request) -> Response:
        body = await body_as(request, UpdateFromDistributedRequest)
        if (no := self._outside_session("update_weights_from_distributed")) is not None:
            return no
        engine = self.engine
        t0 = time.monotonic()
        tensors = await self.groups.receive(body)
        n = await self.call(
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

    async def destroy_weights_update_group(self, request: Request) -> Response:
        body = await body_as(request, DestroyWeightsUpdateGroupRequest)
        self.groups.destroy(body.group_name)
        return json_response(SuccessReply(True, f"weight update group {body.group_name!r} destroyed"))

    async def update_from_xfer(self, request: Request) -> Response:
        body = await body_as(request, UpdateFromXferRequest)
        engine = self.engine
        async with self._xfer_weights:
            t0 = time.monotonic()
            limit = body.timeout_s + 2 * body.control_timeout_s + 5
            snap = await asyncio.wait_for(asyncio.to_thread(self.xfer.pull_snapshot, body), limit)
            pull_s = time.monotonic() - t0
            tensors = snapshot_tensors(snap, engine.model, body.layout)
            check_named_tensors(engine.model, tensors)
            check_complete(engine.model, set(tensors))
            version = body.weight_version or str(snap.version)
            taken: list[float] = []  # when the engine thread took the update

            def apply() -> int:
                taken.append(time.monotonic())
                return apply_named_tensors(engine.model, tensors)

            t1 = time.monotonic()
            n = await self.call(
                engine.update_weights, apply, version, body.flush_cache, body.abort_all_requests
            )
            apply_s = time.monotonic() - t1
        msg = f"loaded snapshot version {snap.version} ({n} tensors) from {body.publisher}"
        wait_s = taken[0] - t1 if taken else 0.0
        return json_response(
            XferWeightsReply(
                True, msg, engine.weight_version, snap.version, n, snap.nbytes, pull_s, apply_s, wait_s
            )
        )
