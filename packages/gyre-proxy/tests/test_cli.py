"""`gyre-proxy serve` as its own process: flags, a call through it, the record log, and the loopback rule."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from gyre_proxy.cli import main
from gyre_traj.io import read_records


def test_serve_subprocess(engine: Any, tokenizer_dir: Path, tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"secret-1": "run-1"}))
    log = tmp_path / "rec.msgpack"
    cmd = [
        sys.executable,
        "-m",
        "gyre_proxy.cli",
        "serve",
        "--tokenizer",
        str(tokenizer_dir),
        "--engine",
        engine.url,
        "--port",
        str(port),
        "--record-log",
        str(log),
        "--api-keys",
        str(keys),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "gyre-proxy serve did not come up"
            time.sleep(0.1)
        engine.script = ["served"]
        body = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(f"{url}/v1/messages", json=body, headers={"x-api-key": "secret-1"})
        assert r.status_code == 200 and r.json()["content"][0]["text"] == "served"
        assert httpx.post(f"{url}/v1/messages", json=body, headers={"x-api-key": "nope"}).status_code == 401
    finally:
        proc.terminate()
        proc.wait(20)
        if proc.stdout:
            proc.stdout.close()
    assert [c.execution_id for c in read_records(log)] == ["run-1"]


def test_refuses_a_public_listener_without_allow_remote() -> None:
    try:
        main(["serve", "--tokenizer", "x", "--host", "0.0.0.0"])
    except SystemExit as exc:
        assert "not loopback" in str(exc)
    else:
        raise AssertionError("expected SystemExit")
