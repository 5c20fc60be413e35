"""The run token (`gyre_base.token`): where it comes from (the setting, else $GYRE_TOKEN; a token file's
first line), the loopback rule every listener applies, and SGLang's bearer check. The module needs the
standard library only: `test_the_token_module_imports_without_pyzmq` runs it where pyzmq cannot load."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from gyre_base import token
from gyre_base.token import (
    MIN_TOKEN_CHARS,
    TOKEN_ENV,
    TokenError,
    TokenRequiredError,
    WeakTokenError,
    authorized,
    bearer,
    is_loopback_endpoint,
    is_loopback_host,
    listener_token,
    needs_token,
    read_token_file,
    resolve_token,
)
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.usefixtures("no_token")

TOKEN = "base-test-token-0123456789abcdef"
WRONG = "base-test-token-fedcba9876543210"


# ---- where the token comes from ----------------------------------------------------------------------------


def test_tokens_come_from_the_setting_then_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert resolve_token("") == ""
    monkeypatch.setenv(TOKEN_ENV, f" {TOKEN}\n")
    assert resolve_token("") == TOKEN
    assert resolve_token(WRONG) == WRONG
    f = tmp_path / "token"
    f.write_text(f"{TOKEN}\n# anything after the first line is ignored\n")
    assert read_token_file(str(f)) == TOKEN
    assert len(token.new_token()) == 43 and token.new_token() != token.new_token()


@settings(max_examples=200, deadline=None)
@given(configured=st.text(max_size=40), env=st.one_of(st.none(), st.text(max_size=40)))
def test_resolution_is_the_setting_else_the_environment_stripped(configured: str, env: str | None) -> None:
    """200 cases of any text in the setting and in $GYRE_TOKEN (or none there)."""
    if "\x00" in (env or ""):
        return  # cannot be an environment variable
    saved = os.environ.pop(TOKEN_ENV, None)
    try:
        if env is not None:
            os.environ[TOKEN_ENV] = env
        assert resolve_token(configured) == (configured or env or "").strip()
    finally:
        os.environ.pop(TOKEN_ENV, None)
        if saved is not None:
            os.environ[TOKEN_ENV] = saved


@pytest.mark.parametrize(
    ("content", "expected"),
    [(f"{TOKEN}\nrest\n", TOKEN), (f"  {TOKEN}  ", TOKEN), ("", None), ("\n\n", None), (None, None)],
)
def test_a_token_file_is_its_first_line_and_never_silently_empty(
    tmp_path: Path, content: str | None, expected: str | None
) -> None:
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    if expected is not None:
        assert read_token_file(str(path)) == expected
        return
    says = "cannot read the token file" if content is None else "holds no token on its first line"
    with pytest.raises(TokenError, match=says):
        read_token_file(str(path))


# ---- the rule ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("tcp://127.0.0.1:5555", True),
        ("tcp://127.1.2.3:0", True),
        ("tcp://[::1]:5555", True),
        ("tcp://localhost:5555", True),
        ("ipc:///tmp/gyre.sock", True),
        ("inproc://x", True),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://*:5555", False),
        ("tcp://eth0:5555", False),
        ("tcp://192.0.2.7:5555", False),
        ("tcp://[::]:5555", False),
        ("tcp://127.0.0.1.example.com:5555", False),
    ],
)
def test_what_counts_as_loopback_for_zeromq(address: str, loopback: bool) -> None:
    assert is_loopback_endpoint(address) is loopback


def test_what_counts_as_loopback_for_http() -> None:
    for host in ("127.0.0.1", "127.3.4.5", "localhost", "::1", "[::1]"):
        assert is_loopback_host(host), host
    for host in ("0.0.0.0", "::", "*", "10.0.0.1", "example.org", "localhost.example.org", ""):
        assert not is_loopback_host(host), host


@pytest.mark.parametrize("address", ["tcp://0.0.0.0:0", "tcp://*:5", "0.0.0.0", "10.1.2.3", "::"])
def test_beyond_loopback_a_listener_needs_a_token_and_the_error_names_the_setting(
    address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(
        TokenRequiredError, match=rf"refusing to bind .* beyond loopback .* {TOKEN_ENV} \(or X\.token\)"
    ):
        listener_token(address, "", "X.token")
    assert listener_token(address, TOKEN, "X.token") == TOKEN
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    assert listener_token(address, "", "X.token") == TOKEN


def test_on_loopback_no_token_is_fine_and_a_given_one_still_counts() -> None:
    for address in ("tcp://127.0.0.1:0", "ipc:///tmp/x", "127.0.0.1", "localhost"):
        assert listener_token(address) == ""
        assert listener_token(address, TOKEN) == TOKEN


def test_short_tokens_are_refused_everywhere() -> None:
    short = "x" * (MIN_TOKEN_CHARS - 1)
    for address in ("tcp://127.0.0.1:0", "0.0.0.0"):
        with pytest.raises(WeakTokenError, match=f"at least {MIN_TOKEN_CHARS}.*gyre-base token"):
            listener_token(address, short)
    assert listener_token("127.0.0.1", "x" * MIN_TOKEN_CHARS) == "x" * MIN_TOKEN_CHARS
    assert issubclass(WeakTokenError, TokenError) and issubclass(TokenError, ValueError)


# ---- HTTP --------------------------------------------------------------------------------------------------


def test_bearer_check_is_sglangs() -> None:
    wrong = [
        None,
        "",
        "Bearer not-the-token-0123456789",
        TOKEN,  # no scheme
        f"Basic {TOKEN}",
        f"Bearer  {TOKEN}",  # SGLang splits once: the key would start with a space
        f"Bearer {TOKEN}x",
        "Bearer \xe9",  # not ASCII (arrives as latin-1, as HTTP headers do)
    ]
    assert authorized(f"Bearer {TOKEN}", TOKEN) and authorized(f"bearer {TOKEN}", TOKEN)
    for header in wrong:
        assert not authorized(header, TOKEN), header
    assert bearer(TOKEN) == {"Authorization": f"Bearer {TOKEN}"} and bearer("") == {}
    assert not needs_token("GET", "/health") and not needs_token("GET", "/health_generate")
    assert not needs_token("GET", "/ready") and not needs_token("GET", "/metrics")
    assert not needs_token("OPTIONS", "/generate")
    assert needs_token("POST", "/generate") and needs_token("GET", "/model_info")


def test_the_base_install_imports_without_pyzmq_or_test_tools(tmp_path: Path) -> None:
    """`zmq`, `pytest`, `hypothesis` and `uvicorn` that fail to import shadow the real ones: the token
    module (and so gyre-engine's client), the tables, the version helper and the test helpers do not
    notice, and `gyre_base.sockets` says which extra to install."""
    for name in ("zmq", "pytest", "hypothesis", "uvicorn"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('{name} is not installed here')\n")
    code = (
        "import sys, gyre_base.token, gyre_base.tables, gyre_base.testing, gyre_base.version, gyre_base.cli\n"
        "assert not {'zmq', 'pytest', 'hypothesis', 'uvicorn'} & set(sys.modules)\n"
        "try:\n"
        "    import gyre_base.sockets\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "pip install 'gyre-base[zmq]'" in out.stdout
