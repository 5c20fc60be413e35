"""Loads a model directory into an Engine and serves it over HTTP with uvicorn (loopback by default).

`load_engine` is what tests and the benchmark use in-process; `serve` is the `gyre-engine serve` command.
A host beyond loopback needs `allow_remote` and a token (`listen.py`); both are checked before the model
loads (by `gyre-engine serve` before torch is even imported), and a missing one exits with status 2 naming
the setting. With a token, on any host, every request but the health probes must carry it as
`Authorization: Bearer <token>` (`gate.py`).
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass, field
from types import FrameType

import torch
import uvicorn
from transformers import AutoModelForCausalLM, AutoTokenizer

from gyre_engine.server.app import AppConfig, build_app
from gyre_engine.server.engine import Engine
from gyre_engine.server.listen import listen_token
from gyre_engine.server.xfer import XferConfig


@dataclass
class ServeConfig:
    model: str
    """Model directory (transformers layout: config, safetensors weights, tokenizer, chat template)."""
    host: str = "127.0.0.1"
    """Address to bind; anything but loopback needs `allow_remote` and a token."""
    port: int = 30000
    device: str = "auto"
    """`cpu`, `cuda`, `cuda:N`, or `auto` (CUDA when available)."""
    dtype: str = "auto"
    """`auto` (the checkpoint's), `float32`, `bfloat16` or `float16`."""
    attn_implementation: str = "sdpa"
    allow_remote: bool = False
    served_model_name: str | None = None
    engine: Engine.Config = field(default_factory=Engine.Config)
    xfer: XferConfig = field(default_factory=XferConfig)
    warmup_decode_tokens: int = 0
    """Capture the decode graphs for rows up to this many tokens before serving (0: on first use)."""
    token: str = ""
    """The run token requests must carry as a bearer token ("": `$GYRE_TOKEN`, else none, which only a
    loopback host may have)."""
    max_body_bytes: int = AppConfig.max_body_bytes
    """Longest request body (413 past it), except for the two bulk paths."""
    max_bulk_body_bytes: int = AppConfig.max_bulk_body_bytes
    """Longest body of /update_weights_from_tensor and /import_prefix."""
    sglang_only: bool = False
    """Serve SGLang's endpoints only (`app.GYRE_ONLY` answer 404): standing in for SGLang in tests."""


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_engine(cfg: ServeConfig) -> Engine:
    """Load model and tokenizer and start the engine thread."""
    dtype = "auto" if cfg.dtype == "auto" else getattr(torch, cfg.dtype)
    model = AutoModelForCausalLM.from_pretrained(
        cfg.model, dtype=dtype, attn_implementation=cfg.attn_implementation
    )
    model.to(resolve_device(cfg.device))  # type: ignore[arg-type]
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    engine = Engine(model, tokenizer, cfg.engine)
    engine.start()
    if cfg.warmup_decode_tokens > 0:
        took = engine.call(engine.warmup_decode, cfg.warmup_decode_tokens).result()
        logging.getLogger(__name__).info("decode graphs captured in %.1f s", took)
    return engine


ALLOC_CONF = "expandable_segments:True"
"""The CUDA caching allocator's setting for an engine process unless PYTORCH_CUDA_ALLOC_CONF is set: with
fixed-size segments, the KV of chunked prefills (grown by concatenation, a new size every chunk) and the
prefix cache's copies fragment the allocator's reserve until it holds far more than its tensors, which a
second engine or a trainer on the same GPU then cannot get; expandable segments map and unmap pages."""


def serve(cfg: ServeConfig) -> None:
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)  # read at the first CUDA allocation
    token = listen_token(cfg.host, cfg.allow_remote, cfg.token)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = load_engine(cfg)
    app_cfg = AppConfig(
        model_path=cfg.model,
        served_model_name=cfg.served_model_name,
        xfer=cfg.xfer,
        token=token,
        max_body_bytes=cfg.max_body_bytes,
        max_bulk_body_bytes=cfg.max_bulk_body_bytes,
        sglang_only=cfg.sglang_only,
    )
    app = build_app(engine, app_cfg)
    # uvicorn shuts down gracefully on SIGTERM, then raises it again into the handler it found: this one,
    # so the cleanup below runs (it removes the process's shared-memory segments, spare KV arenas among
    # them) before the process ends by the signal as it would have
    signal.signal(signal.SIGTERM, _terminated)
    terminated = False
    try:
        uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning", timeout_graceful_shutdown=5)
    except _Terminated:
        terminated = True
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a repeat does not cut the cleanup short
    finally:
        engine.shutdown()
        app.state.generation.close()
        app.state.xfer.close()
        app.state.weight_groups.close()
    if terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


class _Terminated(Exception):
    """SIGTERM arrived (raised by `_terminated`)."""


def _terminated(signum: int, frame: FrameType | None) -> None:
    raise _Terminated
