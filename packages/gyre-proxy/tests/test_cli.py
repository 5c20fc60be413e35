"""`gyre-proxy serve` as its own process: flags derived from `ProxyConfig`, a call through it, the record
log, and the listener rule (loopback unless allowed, and beyond loopback only with API keys)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from gyre_base.testing import free_port
from gyre_proxy.cli import main, parser
from gyre_proxy.config import ConfigError, ProxyConfig
from gyre_proxy.flags import config_from, field_docs
from gyre_proxy.strip import CLAUDE_CODE_BILLING, StripRule
from gyre_traj.io import read_records


def test_serve_subprocess(engine: Any, tokenizer_dir: Path, tmp_path: Path) -> None:
    port = free_port()
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


def test_a_listener_beyond_loopback_without_api_keys_is_refused(tokenizer_dir: Path) -> None:
    """A real `gyre-proxy serve --host 0.0.0.0 --allow-remote` without keys exits before it binds."""
    cmd = [sys.executable, "-m", "gyre_proxy.cli", "serve", "--tokenizer", str(tokenizer_dir)]
    r = subprocess.run([*cmd, "--host", "0.0.0.0", "--allow-remote"], capture_output=True, timeout=120)
    assert r.returncode == 1
    assert b"beyond loopback without per-execution API keys" in r.stderr
    for host in ("0.0.0.0", "::", "192.168.7.7", "example.org"):
        with pytest.raises(ConfigError, match="without per-execution API keys"):
            ProxyConfig(tokenizer="t", host=host, allow_remote=True)
        with pytest.raises(ConfigError, match="not loopback"):
            ProxyConfig(tokenizer="t", host=host, api_keys={"k": "e"})
        assert ProxyConfig(tokenizer="t", host=host, allow_remote=True, api_keys={"k": "e"}).host == host
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert ProxyConfig(tokenizer="t", host=host).host == host


def test_every_setting_is_a_flag(tmp_path: Path) -> None:
    """`serve`'s flags are ProxyConfig's fields (one declaration): each documented, each reaching its field."""
    docs = field_docs(ProxyConfig)
    assert set(docs) == {f.name for f in dataclasses.fields(ProxyConfig)}
    assert all(docs.values())
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"k1": "run-1"}))
    tok = tmp_path / "token"
    tok.write_text("a-run-token-of-enough-length\n")
    argv = ["serve", "--tokenizer", "tok", "--engine", "http://a", "--engine", "http://b"]
    argv += ["--agent-header", "X-Mine", "--strip-rule", "meta=x-meta: [^\\n]*", "--engine-retry-s", "0.5"]
    argv += ["--engine-retry-max-s", "2", "--no-incremental", "--max-context", "100", "--api-keys", str(keys)]
    argv += ["--token-file", str(tok), "--sched", "tcp://127.0.0.1:1", "--port", "9", "--pick-wait", "1.5"]
    argv += ["--max-new-tokens-cap", "64", "--host", "::1"]
    cfg = config_from(ProxyConfig, parser().parse_args(argv))
    want = ProxyConfig(
        tokenizer="tok",
        engines=("http://a", "http://b"),
        agent_headers=("x-mine",),
        strip_rules=(StripRule("meta", "x-meta: [^\\n]*"),),
        engine_retry_s=0.5,
        engine_retry_max_s=2.0,
        incremental=False,
        max_context_tokens=100,
        api_keys={"k1": "run-1"},
        token="a-run-token-of-enough-length",
        sched="tcp://127.0.0.1:1",
        port=9,
        pick_wait_s=1.5,
        max_new_tokens_cap=64,
        host="::1",
    )
    assert cfg == want
    defaults = config_from(ProxyConfig, parser().parse_args(["serve", "--tokenizer", "tok"]))
    assert defaults == ProxyConfig(tokenizer="tok")
    assert defaults.strip_rules == (CLAUDE_CODE_BILLING,)
    none = parser().parse_args(["serve", "--tokenizer", "tok", "--strip-rule=", "--agent-header="])
    assert config_from(ProxyConfig, none).strip_rules == () == config_from(ProxyConfig, none).agent_headers
    with pytest.raises(SystemExit):
        parser().parse_args(["serve", "--tokenizer", "tok", "--strip-rule", "no-equals-sign"])


def test_a_weak_token_is_refused_at_start(tokenizer_dir: Path, tmp_path: Path) -> None:
    tok = tmp_path / "token"
    tok.write_text("short\n")
    with pytest.raises(SystemExit, match="at least 16"):
        main(["serve", "--tokenizer", str(tokenizer_dir), "--token-file", str(tok)])
