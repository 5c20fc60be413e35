"""End to end with the embedded tiny model: a real gyre-engine server subprocess (real sampling on the
CPU) behind the proxy, driven by the official SDKs. The content is nonsense; the protocol and the
records are exact: outputs as sampled, later inputs extend earlier input + output unchanged."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import numpy as np
import openai
import pytest
from gyre_traj.io import read_records
from gyre_traj.records import Call

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    from gyre_engine.server.model_factory import create_model

    model = create_model(tmp_path_factory.mktemp("tiny") / "model", "tiny")
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = int(sk.getsockname()[1])
    log = open(tmp_path_factory.mktemp("elog") / "engine.log", "wb")  # noqa: SIM115
    cmd = [
        sys.executable,
        "-m",
        "gyre_engine",
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
        "--device",
        "cpu",
    ]
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError("gyre-engine exited early")
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("gyre-engine did not become ready in 120 s")
            time.sleep(0.3)
        yield url, model
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(20)
        log.close()


def _full(recs: list[Call]) -> list[np.ndarray]:
    seq: dict[str, np.ndarray] = {}
    out = []
    for r in recs:
        if r.input_ids is not None:
            inp = r.input_ids
        else:
            assert r.input_delta is not None
            inp = np.concatenate([seq[r.input_delta.parent][: r.input_delta.keep], r.input_delta.append])
        seq[r.call_id] = np.concatenate([inp, r.output_ids])
        out.append(inp)
    return out


def test_tiny_model_behind_the_proxy(tiny_engine: tuple[str, Path], make_proxy: Any, request: Any) -> None:
    url, model = tiny_engine
    ps = make_proxy([url], tokenizer=str(model))
    client = anthropic.Anthropic(base_url=ps.url, api_key="k", max_retries=0)
    request.addfinalizer(client.close)
    msgs: list[Any] = [{"role": "user", "content": "Write a function."}]
    r1 = client.messages.create(model="tiny", max_tokens=12, messages=msgs)
    assert r1.usage.output_tokens >= 1
    msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r1.content] or "x"}]
    msgs += [{"role": "user", "content": "Again."}]
    with client.messages.stream(model="tiny", max_tokens=12, messages=msgs) as st:
        list(st)
        r2 = st.get_final_message()
    assert r2.usage.output_tokens >= 1
    oa = openai.OpenAI(base_url=f"{ps.url}/v1", api_key="k", max_retries=0)
    request.addfinalizer(oa.close)
    r3 = oa.chat.completions.create(model="tiny", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert r3.usage is not None and r3.usage.completion_tokens >= 1

    recs = [r for r in read_records(ps.log_path) if isinstance(r, Call)]
    assert len(recs) == 3
    inputs = _full(recs)
    for r in recs:
        assert 1 <= r.output_ids.size <= 12 and np.all(r.output_logprobs <= 0)
    first = np.concatenate([inputs[0], recs[0].output_ids]).tolist()
    if r1.content:  # the second call carries the first call's sampled ids unchanged
        assert inputs[1].tolist()[: len(first)] == first
    assert recs[0].output_ids.size == r1.usage.output_tokens
