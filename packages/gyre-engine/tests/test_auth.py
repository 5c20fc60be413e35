"""The engine's bearer token: a bind beyond loopback without a token is refused; with one,
every request but the health probes must carry it, and one that does not is SGLang's 401 and does no
work; gyre-engine's client and SGLang launcher carry it. The rule and the bearer check are gyre-base's
(`gyre_base.token`, tested there); here they are proved on the engine's own server, client and launcher."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from gyre_base import token
from gyre_base.testing import env_without_token
from gyre_engine.client import EngineClient, EngineError
from gyre_engine.launcher import SGLangConfig, wait_healthy
from gyre_engine.protocol import SamplingParams

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent))  # the shared helpers (tests run with --import-mode=importlib)
from routes import ROUTES  # noqa: E402
from sglang_shapes import fixture  # noqa: E402

TOKEN = "engine-auth-token-0123456789abcdef"
USER = [1200 + i * 7 for i in range(9)]
WRONG = [
    {},
    {"Authorization": "Bearer not-the-token-0123456789"},
    {"Authorization": TOKEN},  # no scheme
    {"Authorization": f"Basic {TOKEN}"},
    {"Authorization": f"Bearer  {TOKEN}"},  # SGLang splits once: the key would start with a space
    {"Authorization": f"Bearer {TOKEN}x"},
    {"Authorization": "Bearer \xe9"},  # not ASCII (sent as latin-1, as HTTP headers are)
]


# ---- the rule ------------------------------------------------------------------------------------------


def test_the_default_bind_is_loopback() -> None:
    from gyre_engine.cli import main  # noqa: F401 - the CLI's default is the config's
    from gyre_engine.server.serve import ServeConfig

    assert ServeConfig("m").host == "127.0.0.1" and token.is_loopback_host("127.0.0.1")
    assert SGLangConfig("m").host == "127.0.0.1"


@pytest.mark.parametrize(
    ("args", "env_token", "says"),
    [
        (("--host", "0.0.0.0", "--allow-remote"), None, "GYRE_TOKEN"),
        (("--host", "0.0.0.0", "--allow-remote"), "short", "at least 16"),
        (("--host", "0.0.0.0"), TOKEN, "--allow-remote"),
    ],
)
def test_serve_beyond_loopback_without_a_token_is_refused(
    tmp_path: Path, args: tuple[str, ...], env_token: str | None, says: str
) -> None:
    """Before the model loads (the model path does not even exist): exit status 2 and a message naming
    the setting."""
    env = env_without_token()
    if env_token is not None:
        env[token.TOKEN_ENV] = env_token
    cmd = [sys.executable, "-m", "gyre_engine", "serve", "--model", str(tmp_path / "none"), *args]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert says in p.stderr
    if says == "GYRE_TOKEN":
        assert "--token-file" in p.stderr


# ---- a server that has a token -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def token_server(spawn_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Listening on every interface, with the token from a file (GYRE_TOKEN unset)."""
    path = tmp_path_factory.mktemp("token") / "token"
    path.write_text(TOKEN + "\n")
    saved = os.environ.pop(token.TOKEN_ENV, None)
    try:
        return spawn_server("--host", "0.0.0.0", "--allow-remote", "--token-file", str(path))
    finally:
        if saved is not None:
            os.environ[token.TOKEN_ENV] = saved


def _counters(url: str) -> dict[str, Any]:
    info = httpx.get(f"{url}/server_info", headers=token.bearer(TOKEN), timeout=30).json()
    return {k: info[k] for k in info if k != "cached_prefix_tokens"}


def test_requests_without_the_token_get_sglangs_401_and_do_no_work(token_server: Any) -> None:
    """Every route (the KV-transfer and gyre-xfer ones included) and an unknown path, with each kind of
    missing or wrong header: SGLang's recorded 401 body, and the engine's counters, pause state, weight
    version and prefix offers unchanged."""
    url = token_server.url
    theirs = fixture("unauthorized_no_key")
    before = _counters(url)
    body = {
        "input_ids": USER,
        "sampling_params": {"max_new_tokens": 4},
        "mode": "in_place",
        "abort_all": True,
    }
    for path, methods in [*ROUTES, ("/no_such_route", ("POST",))]:
        if path.startswith(token.OPEN_PATH_PREFIXES):
            continue
        for method in methods:
            for headers in WRONG:
                sent = {k: v.encode("latin-1") for k, v in headers.items()}
                raw = httpx.request(method, f"{url}{path}", json=body, headers=sent, timeout=30)
                assert raw.status_code == 401, (path, headers)
                assert raw.json() == theirs["body"] == {"error": "Unauthorized"}
    assert _counters(url) == before


def test_health_probes_need_no_token_as_in_sglang(token_server: Any) -> None:
    for path in ("/health", "/health_generate", "/ready"):
        r = httpx.get(f"{token_server.url}{path}", timeout=60)
        assert r.status_code == 200 == fixture("health_no_key")["status"], path


def test_the_client_with_the_token_works(token_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    url = token_server.url
    sp = SamplingParams(max_new_tokens=3, temperature=0.0)

    async def go() -> None:
        async with EngineClient(url, timeout_s=60, api_key=TOKEN) as c:
            r = await c.generate(USER, sp)
            chunks = [ch async for ch in c.stream(USER, sp)]
            assert chunks[-1].output_ids == r.output_ids
            await c.pause("in_place")
            assert (await c.server_info()).paused
            await c.continue_generation()
            assert (await c.load()).source == "gyre-engine"
            rec = await c.export_prefix(USER + r.output_ids)
            assert rec is not None and await c.offer_prefix(USER, transport="shm") is not None
        monkeypatch.setenv(
            token.TOKEN_ENV, TOKEN
        )  # the token from the environment, as gyre's processes get it
        async with EngineClient(url, timeout_s=60) as c:
            assert (await c.generate(USER, sp)).output_ids == r.output_ids
        await wait_healthy(url, 30, api_key=TOKEN)
        async with EngineClient(url, timeout_s=60, api_key="not-the-token-0123456789") as c:
            with pytest.raises(EngineError) as info:
                await c.generate(USER, sp)
            assert (info.value.status, info.value.message) == (401, "Unauthorized")

    asyncio.run(go())


# ---- SGLang's launcher ---------------------------------------------------------------------------------


def test_the_sglang_launcher_passes_the_token_as_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(token.TOKEN_ENV, raising=False)
    cmd = SGLangConfig("m", api_key=TOKEN).command()
    assert cmd[cmd.index("--api-key") + 1] == TOKEN
    assert "--api-key" not in SGLangConfig("m").command()
    with pytest.raises(token.TokenRequiredError, match="GYRE_TOKEN"):
        SGLangConfig("m", host="0.0.0.0").command()
    assert TOKEN not in repr(SGLangConfig("m", api_key=TOKEN))
    monkeypatch.setenv(token.TOKEN_ENV, TOKEN)
    cmd = SGLangConfig("m", host="0.0.0.0").command()
    assert cmd[cmd.index("--api-key") + 1] == TOKEN


def test_sglang_command_reads_the_token_at_run_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from gyre_engine.cli import main

    monkeypatch.setenv(token.TOKEN_ENV, TOKEN)
    main(["sglang-command", "--model", "/m", "--host", "0.0.0.0"])
    out = capsys.readouterr().out
    assert '--api-key "$GYRE_TOKEN"' in out and TOKEN not in out
    path = tmp_path / "tok"
    path.write_text(TOKEN)
    main(["sglang-command", "--model", "/m", "--token-file", str(path)])
    out = capsys.readouterr().out
    assert f'--api-key "$(head -n1 {path})"' in out and TOKEN not in out
    monkeypatch.delenv(token.TOKEN_ENV)
    with pytest.raises(SystemExit) as exc:
        main(["sglang-command", "--model", "/m", "--host", "0.0.0.0"])
    assert exc.value.code == 2 and "GYRE_TOKEN" in capsys.readouterr().err


def test_the_route_list_is_the_apps(model_dir: Path) -> None:
    """`routes.ROUTES`, which the 401 test above and the fuzzer walk, is every route the app serves."""
    from gyre_engine.server.app import AppConfig, build_app
    from gyre_engine.server.serve import ServeConfig, load_engine

    engine = load_engine(ServeConfig(model=str(model_dir), device="cpu"))
    try:
        app = build_app(engine, AppConfig(model_path=str(model_dir)))
        served = {(r.path, tuple(sorted(set(r.methods or ()) - {"HEAD"}))) for r in app.routes}  # type: ignore[attr-defined]
        app.state.generation.close()
        app.state.xfer.close()
        app.state.weight_groups.close()
    finally:
        engine.shutdown()
    assert served == {(p, tuple(sorted(m))) for p, m in ROUTES}
