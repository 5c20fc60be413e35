"""Authentication of the scheduler beyond loopback, over real sockets and real processes: a bind beyond
loopback without a token is refused (library and `gyre-sched serve`); with a token, peers holding it are
served and peers without it, with a wrong one, or with only the server's public key get nothing, never
reach the decoder, and the service keeps serving the good peers."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest
import zmq
from gyre_base.sockets import derive_keys, make_socket
from gyre_base.testing import env_without_token
from gyre_base.token import TOKEN_ENV, TokenRequiredError, is_loopback_endpoint
from gyre_sched.client import dealer
from gyre_sched.policy import WaterLevelConfig, WaterLevelPolicy
from gyre_sched.protocol import Codec, GetState, Hello, Message, PeerKind, State, Welcome
from gyre_sched.service import Scheduler, ServiceConfig

Ctx = zmq.Context[zmq.Socket[bytes]]
TOKEN = "sched-test-token-0123456789abcdef"
WRONG = "sched-test-token-fedcba9876543210"


pytestmark = pytest.mark.usefixtures("no_token")


@contextmanager
def serving(bind: str, token: str) -> Iterator[Scheduler]:
    cfg = ServiceConfig(bind=bind, token=token, heartbeat_s=0.2, failure_timeout_s=30.0)
    s = Scheduler(WaterLevelPolicy(WaterLevelConfig(hold_s=60.0, ready_fraction=1.0)), cfg)
    th = threading.Thread(target=s.serve_forever, daemon=True)
    th.start()
    try:
        yield s
        assert th.is_alive(), "the service loop died"
    finally:
        s.stop()
        th.join(5.0)


def ask(sock: zmq.Socket[bytes], msg: Message, timeout_s: float = 5.0) -> Message | None:
    codec = Codec()
    try:
        sock.send(codec.encode(msg), zmq.NOBLOCK)
    except zmq.Again:  # a refused handshake leaves no connection to queue on
        return None
    if not sock.poll(int(timeout_s * 1000)):
        return None
    return codec.decode(sock.recv())


def test_bind_beyond_loopback_without_a_token_is_refused(beyond_loopback: str) -> None:
    for bind in (f"tcp://{beyond_loopback}:0", "tcp://*:0", "tcp://0.0.0.0:0"):
        with pytest.raises(TokenRequiredError, match=rf"refusing to bind .* {TOKEN_ENV} .*--token-file"):
            Scheduler(WaterLevelPolicy(), ServiceConfig(bind=bind))


def test_serve_beyond_loopback_without_a_token_exits_naming_the_setting(beyond_loopback: str) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "gyre_sched.cli", "serve", "--bind", f"tcp://{beyond_loopback}:0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env_without_token(),
        check=False,
    )
    assert p.returncode == 2
    assert (
        f"refusing to bind tcp://{beyond_loopback}:0 beyond loopback without a token: set {TOKEN_ENV}"
        in p.stderr
    )


def test_token_holders_are_served_and_nobody_else_reaches_the_decoder(
    beyond_loopback: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    ctx: Ctx = zmq.Context()
    with serving(f"tcp://{beyond_loopback}:0", TOKEN) as s:
        assert s.endpoint.startswith(f"tcp://{beyond_loopback}:")
        obs = dealer(ctx, s.endpoint, TOKEN)
        assert isinstance(ask(obs, Hello(PeerKind.OBSERVER)), Welcome)
        keyed = make_socket(ctx, zmq.DEALER)  # knows the server's public key, not the token's client key
        keyed.curve_serverkey = derive_keys(TOKEN).server_public
        keyed.curve_publickey, keyed.curve_secretkey = zmq.curve_keypair()
        keyed.connect(s.endpoint)
        intruders = {"no token": dealer(ctx, s.endpoint, ""), "wrong token": dealer(ctx, s.endpoint, WRONG)}
        intruders["server key only"] = keyed
        for name, bad in intruders.items():
            assert ask(bad, Hello(PeerKind.CELL, cell_id=0, is_core=True, capacity=8), 1.0) is None, name
            for junk in ([b"\xc1garbage"], [b"a", b"b"]):
                with suppress(zmq.Again):
                    bad.send_multipart(junk, zmq.NOBLOCK)
            assert not bad.poll(300), f"{name}: the service answered"
            state = ask(obs, GetState())
            assert isinstance(state, State) and state.cells == (), name
        cell = dealer(ctx, s.endpoint, TOKEN)
        assert isinstance(ask(cell, Hello(PeerKind.CELL, cell_id=0, is_core=True, capacity=8)), Welcome)
        state = ask(obs, GetState())
        assert isinstance(state, State) and [c.cell_id for c in state.cells] == [0]
    ctx.destroy(0)
    texts = [r.getMessage() for r in caplog.records]
    assert not [t for t in texts if "refused a message" in t], "a frame of an intruder reached the decoder"
    assert [t for t in texts if t.startswith(f"refused a ZeroMQ peer from {beyond_loopback}")]  # ZAP said no


def test_a_token_on_loopback_is_required_of_peers_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """A token set in the environment applies to loopback listeners as well: one run, one rule."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    ctx: Ctx = zmq.Context()
    with serving("tcp://127.0.0.1:0", "") as s:
        holder = dealer(ctx, s.endpoint)
        assert isinstance(ask(holder, Hello(PeerKind.OBSERVER)), Welcome)
        monkeypatch.delenv(TOKEN_ENV)
        stranger = dealer(ctx, s.endpoint)
        assert ask(stranger, Hello(PeerKind.OBSERVER), 1.0) is None
        assert isinstance(ask(holder, GetState()), State)
    ctx.destroy(0)


@pytest.mark.slow
def test_cell_processes_with_and_without_the_token(beyond_loopback: str, tmp_path: Path) -> None:
    """Real `gyre-sched serve` and `gyre-sched cell` processes: a cell given the token by file and one
    given it by GYRE_TOKEN register; one with a wrong token exits 2 saying why it may have been refused."""
    good, wrong = tmp_path / "token", tmp_path / "wrong"
    good.write_text(TOKEN + "\n")
    wrong.write_text(WRONG + "\n")
    env = env_without_token()
    serve = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gyre_sched.cli",
            "serve",
            "--bind",
            f"tcp://{beyond_loopback}:0",
            "--token-file",
            str(good),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    cells: list[subprocess.Popen[str]] = []
    ctx: Ctx = zmq.Context()
    try:
        assert serve.stdout is not None
        endpoint = serve.stdout.readline().split()[3]
        assert endpoint.startswith(f"tcp://{beyond_loopback}:")

        def cell(i: int, extra: list[str], cell_env: dict[str, str]) -> subprocess.Popen[str]:
            argv = ["cell", "--connect", endpoint, "--id", str(i), "--hello-timeout-s", "3", *extra]
            p = subprocess.Popen(
                [sys.executable, "-m", "gyre_sched.cli", *argv],
                stderr=subprocess.PIPE,
                text=True,
                env=cell_env,
            )
            cells.append(p)
            return p

        cell(0, ["--core", "--token-file", str(good)], env)
        cell(1, [], {**env, TOKEN_ENV: TOKEN})
        bad = cell(2, ["--token-file", str(wrong)], env)
        _, err = bad.communicate(timeout=60)
        assert bad.returncode == 2
        assert "no Welcome" in err and f"{TOKEN_ENV} or --token-file" in err
        obs = dealer(ctx, endpoint, TOKEN)
        assert isinstance(ask(obs, Hello(PeerKind.OBSERVER)), Welcome)
        for _ in range(100):
            state = ask(obs, GetState())
            assert isinstance(state, State)
            if len(state.cells) == 2:
                break
            threading.Event().wait(0.1)
        assert sorted(c.cell_id for c in state.cells) == [0, 1]
    finally:
        for p in (*cells, serve):
            p.kill()
            p.communicate(timeout=30)
        ctx.destroy(0)


def test_default_binds_are_loopback() -> None:
    from gyre_sched.cli import build_parser

    assert is_loopback_endpoint(ServiceConfig().bind)
    assert is_loopback_endpoint(build_parser().parse_args(["serve"]).bind)
    with serving("tcp://127.0.0.1:0", "") as s:  # no token: as before, any local peer is served
        ctx: Ctx = zmq.Context()
        plain = make_socket(ctx, zmq.DEALER)
        plain.connect(s.endpoint)
        assert s.endpoint.startswith("tcp://127.0.0.1:")
        assert isinstance(ask(plain, Hello(PeerKind.OBSERVER)), Welcome)
        ctx.destroy(0)
