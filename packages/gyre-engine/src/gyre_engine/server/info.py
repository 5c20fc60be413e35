"""What the engine says about itself: /model_info (and SGLang's older /get_model_info), the load in
SGLang's /v1/loads shape, gyre's own counters (/server_info), and readiness (/ready). Read without
waiting for the engine thread: counters may be one step old.
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gyre_engine.protocol import Loads, LoadSnapshot, ModelInfo, ServerInfo
from gyre_engine.server.engine import Engine
from gyre_engine.server.errors import json_response
from gyre_engine.server.routing import route
from gyre_engine.server.xfer import XferHub


class InfoRoutes:
    """/model_info, /get_model_info, /server_info, /v1/loads and /ready over one engine."""

    def __init__(self, engine: Engine, xfer: XferHub, model_path: str, served_model_name: str | None) -> None:
        self.engine = engine
        self.xfer = xfer
        self.model_path = model_path
        self.served_model_name = served_model_name or model_path

    def routes(self) -> list[Route]:
        return [
            route("/model_info", self.model_info, "GET"),
            route("/get_model_info", self.model_info, "GET"),
            route("/server_info", self.server_info, "GET"),
            route("/v1/loads", self.loads, "GET"),
            route("/ready", self.ready, "GET"),
        ]

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
            )
        )

    async def ready(self, request: Request) -> Response:
        engine = self.engine
        return Response(b"", status_code=200 if engine.alive and not engine.released else 503)
