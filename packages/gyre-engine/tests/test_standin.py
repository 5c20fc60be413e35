"""gyre-engine standing in for SGLang: `--sglang-only` (gyre's own endpoints answer 404, SGLang's are
served, `/v1/loads` in SGLang's shape) and `python -m gyre_engine.standin`, which takes the flags of
SGLang's `launch_server` that `SGLangConfig` writes."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
from gyre_base.testing import free_port
from gyre_engine.client import EngineClient
from gyre_engine.launcher import SGLangConfig, wait_healthy
from gyre_engine.protocol import Loads, LoadSnapshot
from gyre_engine.server.app import GYRE_ONLY

FIXTURES = Path(__file__).parent / "fixtures" / "sglang-0.5.23"


@pytest.fixture(scope="module")
def standin(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangConfig]:
    """The launcher's own argv with the stand-in's module, waited for as SGLang is (/health_generate)."""
    cfg = SGLangConfig(
        model_path=str(model_dir),
        port=free_port(),
        module="gyre_engine.standin",
        weight_version="0",
        random_seed=1,
        max_running_requests=8,
        skip_server_warmup=True,
        extra_args=("--device", "cpu"),
    )
    log_path = tmp_path_factory.mktemp("standin") / "standin.log"
    log = open(log_path, "wb")  # noqa: SIM115 - closed below
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cfg.command(), stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        asyncio.run(wait_healthy(cfg.url, 600.0, proc, poll_s=0.5))
        yield cfg
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def test_sglang_only_serves_sglangs_endpoints_only(standin: SGLangConfig) -> None:
    with httpx.Client(base_url=standin.url, timeout=60) as h:
        for path in GYRE_ONLY:
            r = h.get(path) if path == "/server_info" else h.post(path, json={})
            assert r.status_code == 404, (path, r.status_code)
        assert h.get("/model_info").json()["weight_version"] == "0"
        r = h.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 2
        loads = msgspec.json.decode(h.get("/v1/loads").content, type=Loads)
        assert len(loads.loads) == 1 and loads.loads[0].total_prefill_uncached_tokens >= 3
        assert loads.loads[0].decode_moments is not None and loads.loads[0].decode_moments[0] >= 1

    async def load() -> tuple[str, int]:
        async with EngineClient(standin.url) as c:
            got = await c.load()
            return got.source, got.work

    source, work = asyncio.run(load())
    assert source == "sglang" and work >= 4  # read the way SGLang is read: /v1/loads and /model_info


def test_loads_has_sglangs_keys() -> None:
    """Every key gyre-engine's /v1/loads rank carries is one SGLang 0.5.23's carries."""
    recorded = json.loads((FIXTURES / "loads_busy.json").read_text())["body"]["loads"][0]
    assert set(LoadSnapshot.__struct_fields__) <= set(recorded)


def test_standin_refuses_what_it_cannot_honour() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "gyre_engine.standin", "--model-path", "/nonexistent", "--tp-size", "2"],
        capture_output=True,
        timeout=60,
    )
    assert p.returncode == 2 and b"cannot honour --tp-size 2" in p.stderr
