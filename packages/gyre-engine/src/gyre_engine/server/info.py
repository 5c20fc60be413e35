"""What the engine says about itself: /model_info (and SGLang's older /get_model_info), its configuration
in SGLang's /get_server_info shape, the load in SGLang's /v1/loads shape, gyre's own counters
(/server_info), readiness (/ready), and a parameter's values (/get_weights_by_name, read on the engine
thread between two steps, so never half updated). The rest is read without waiting for the engine
thread: counters may be one step old.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import torch
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gyre_engine.protocol import (
    GetWeightsByNameRequest,
    Loads,
    LoadSnapshot,
    ModelInfo,
    ServerInfo,
    SGLangInternalState,
    SGLangServerArgs,
    SGLangServerInfo,
)
from gyre_engine.server.engine import Engine
from gyre_engine.server.errors import error_response, json_response
from gyre_engine.server.routing import EngineCalls, body_as, route
from gyre_engine.server.xfer import XferHub


class InfoRoutes:
    """/model_info, /get_model_info, /get_server_info, /server_info, /v1/loads, /ready and
    /get_weights_by_name over one engine."""

    def __init__(
        self,
        engine: Engine,
        call: EngineCalls,
        xfer: XferHub,
        model_path: str,
        served_model_name: str | None,
    ) -> None:
        self.engine = engine
        self.call = call
        self.xfer = xfer
        self.model_path = model_path
        self.served_model_name = served_model_name or model_path
        self.started_as = engine.weight_version
        """The weight version the server started with (SGLang's server argument)."""

    def routes(self) -> list[Route]:
        return [
            route("/model_info", self.model_info, "GET"),
            route("/get_model_info", self.model_info, "GET"),
            route("/get_server_info", self.get_server_info, "GET"),
            route("/server_info", self.server_info, "GET"),
            route("/v1/loads", self.loads, "GET"),
            route("/ready", self.ready, "GET"),
            route("/get_weights_by_name", self.get_weights_by_name, "GET", "POST"),
        ]

    def _server_args(self) -> SGLangServerArgs:
        engine = self.engine
        p = next(engine.model.parameters())
        return SGLangServerArgs(
            model_path=self.model_path,
            tokenizer_path=self.model_path,
            served_model_name=self.served_model_name,
            skip_tokenizer_init=engine.tokenizer is None,
            context_length=engine.context_len,
            dtype=str(p.dtype).removeprefix("torch."),
            device=engine.device.type,
            max_running_requests=engine.config.max_running_requests,
            weight_version=self.started_as,
        )

    async def get_server_info(self, request: Request) -> Response:
        """SGLang's deprecated alias of its /server_info: its configuration, under its names."""
        args = msgspec.structs.asdict(self._server_args())
        running = self.engine.config.max_running_requests
        rank = SGLangInternalState(**args, effective_max_running_requests_per_dp=running)
        info = SGLangServerInfo(
            **args,
            max_total_num_tokens=running * self.engine.context_len,
            max_req_input_len=self.engine.context_len - 1,
            internal_states=[rank],
        )
        return json_response(info)

    async def get_weights_by_name(self, request: Request) -> Response:
        """SGLang's reading of a parameter: float32, the first `truncate_size` entries of its first
        dimension (Python's slice: a negative size counts from the end), as nested lists."""
        body = await body_as(request, GetWeightsByNameRequest)
        values = await self.call(_weights_by_name, self.engine.model, body.name, body.truncate_size)
        if values is None:
            return error_response(f"Get parameter by name failed: the model has no parameter {body.name!r}")
        return json_response(values)

    async def model_info(self, request: Request) -> Response:
        engine = self.engine
        p = next(engine.model.parameters())
        hf = getattr(engine.model, "config", None)
        return json_response(
            ModelInfo(
                model_path=self.model_path,
                served_model_name=self.served_model_name,
                tokenizer_path=self.model_path,
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

    async def loads(self, request: Request) -> Response:
        """SGLang's GET /v1/loads: one data-parallel rank from the engine's counters. `decode_moments` holds
        decode steps, tokens (the sum of batch sizes), and step microseconds; squared sizes and size x
        microseconds are not tracked (0)."""
        st = self.engine.stats()
        running, waiting = self.engine.counts()
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

    async def server_info(self, request: Request) -> Response:
        engine = self.engine
        st = engine.stats()
        slots = engine.slot_stats()
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
                open_prefix_offers=self.xfer.open_offers,
                prefill_time_s=round(st.prefill_time_s, 4),
                prefill_passes=st.prefill_passes,
                prefill_graph_passes=int(slots.get("prefill_replays", 0)),
                decode_time_s=round(st.decode_time_s, 4),
                graph_captures=int(slots.get("captures", 0)) + int(slots.get("long_captures", 0)),
                graph_capture_s=round(
                    float(slots.get("capture_s", 0.0)) + float(slots.get("long_capture_s", 0.0)), 4
                ),
                slot_grows=int(slots.get("grows", 0)),
                cache_returns=st.cache_returns,
                memory_evicted_tokens=st.memory_evicted_tokens,
                host_cached_prefix_tokens=st.host_cached_tokens,
                host_spilled_tokens=st.host_spilled_tokens,
                host_hit_tokens=st.host_hit_tokens,
                step_time_s=round(st.step_time_s, 4),
                command_time_s=round(st.command_time_s, 4),
                waiting_s={k: round(v, 4) for k, v in st.waiting_s.items()},
                **_device_memory(engine.device),
            )
        )

    async def ready(self, request: Request) -> Response:
        engine = self.engine
        return Response(b"", status_code=200 if engine.alive and not engine.released else 503)


def _device_memory(device: torch.device) -> dict[str, int]:
    if device.type != "cuda":
        return {}
    return {
        "device_allocated_bytes": torch.cuda.memory_allocated(device),
        "device_reserved_bytes": torch.cuda.memory_reserved(device),
        "device_peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
    }


def _weights_by_name(model: torch.nn.Module, name: str, truncate_size: int) -> list[Any] | None:
    """The values of parameter `name` (a tied parameter under either name) as /get_weights_by_name
    answers them; None when the model has no such parameter, or it has no dimension to slice."""
    param = dict(model.named_parameters(remove_duplicate=False)).get(name)
    if param is None or param.dim() == 0:
        return None
    rows = range(param.shape[0])[:truncate_size]  # Python's slice, whatever the size's magnitude
    with torch.no_grad():
        values: list[Any] = param[rows.start : rows.stop].detach().to("cpu", torch.float32).tolist()
    return values
