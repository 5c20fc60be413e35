"""The HTTP face of the engine: SGLang's native endpoints as a Starlette app, assembled from route groups.

Every request passes the gate first (`gate.py`: the bearer token when the server has one, the bounds on
body sizes). Each route group is a class over the engine (`generate.py`: /generate and the health probe;
`control.py`: abort, pause, memory, cache; `updates.py`: weight updates; `prefixes.py`: prefix hand-off;
`info.py`: model info, configuration, load, counters, a parameter's values); their handlers decode bodies with msgspec, hand work to the engine
thread through `Engine.call`, and wait with a timeout (`routing.py`). Every error is in SGLang's shape
(`errors.py`): bad input is a 400, a request the engine cannot take now (paused, released, updating) is a
409 marked retryable, an unknown path or method is FastAPI's 404 / 405 as SGLang sends it; the server
keeps serving.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gyre_xfer.pinning import host_pinning
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware

from gyre_engine.server.control import ControlRoutes
from gyre_engine.server.dist_update import WeightGroups
from gyre_engine.server.engine import Engine
from gyre_engine.server.errors import http_exception, unhandled
from gyre_engine.server.gate import BodyLimits, Gate
from gyre_engine.server.generate import GenerateRoutes
from gyre_engine.server.info import InfoRoutes
from gyre_engine.server.prefixes import PrefixRoutes
from gyre_engine.server.routing import EngineCalls
from gyre_engine.server.updates import WeightRoutes
from gyre_engine.server.xfer import XferConfig, XferHub


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
    """The Starlette app serving `engine`: the route groups' routes behind the gate. `app.state` holds
    what `serve` closes at shutdown: the generation routes, the gyre-xfer hub and the weight groups."""
    xfer = XferHub(config.xfer, pinning=host_pinning(engine.device))
    groups = WeightGroups(engine.model, engine.device)  # SGLang's distributed weight-update groups
    call = EngineCalls(engine, config.control_timeout_s)
    gen = GenerateRoutes(engine, config.request_timeout_s, config.control_timeout_s, config.health_timeout_s)
    groups_of_routes = (
        gen,
        ControlRoutes(engine, call),
        WeightRoutes(engine, call, groups, xfer),
        InfoRoutes(engine, call, xfer, config.model_path, config.served_model_name),
        PrefixRoutes(engine, call, xfer),
    )
    routes = [r for g in groups_of_routes for r in g.routes()]
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
