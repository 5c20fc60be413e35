"""Loads a model directory into an Engine and serves it over HTTP with uvicorn (loopback by default).

`load_engine` is what tests and the benchmark use in-process; `serve` is the `gyre-engine serve` command.
A non-loopback host is refused unless `allow_remote` is set, because the control endpoints can replace
the weights.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import uvicorn
from transformers import AutoModelForCausalLM, AutoTokenizer

from gyre_engine.server.app import AppConfig, build_app
from gyre_engine.server.engine import Engine
from gyre_engine.server.xfer import XferConfig

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass
class ServeConfig:
    model: str
    """Model directory (transformers layout: config, safetensors weights, tokenizer, chat template)."""
    host: str = "127.0.0.1"
    """Address to bind; anything but loopback needs `allow_remote`."""
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


def serve(cfg: ServeConfig) -> None:
    if cfg.host not in LOOPBACK and not cfg.allow_remote:
        raise SystemExit(
            f"refusing to bind {cfg.host}: the control endpoints replace weights; pass --allow-remote"
        )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = load_engine(cfg)
    app = build_app(
        engine,
        AppConfig(
            model_path=cfg.model,
            served_model_name=cfg.served_model_name,
            xfer=cfg.xfer,
            sglang_only=cfg.sglang_only,
        ),
    )
    try:
        uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning", timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()
        app.state.xfer.close()
        app.state.weight_groups.close()
