"""Authentication of gyre-train's listeners beyond loopback, over real sockets and a real process: the
core's ROUTER and a cell's in-cell link refuse a bind beyond loopback without a token (library and
`gyre-train core`); with a token, satellites and `CoreClient`s holding it are answered (the satellite
also pulls the weights from the core's publisher with it) and those without it, or with a wrong one, get
no answer: a typed error at their deadline, never a hang."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from gyre_base.testing import env_without_token
from gyre_base.token import TOKEN_ENV, TokenRequiredError
from gyre_train.cell import ParallelConfig
from gyre_train.cellctl import FollowerLink, LeaderLink, RankSilentError
from gyre_train.cli import build_parser, main
from gyre_train.control import ControlError, CoreClient
from gyre_train.core import Core, CoreConfig
from gyre_train.model import ModelConfig, build_model
from gyre_train.protocol import Publish, RankReply
from gyre_train.satellite import CoreGoneError, Satellite, SatelliteConfig

MC = ModelConfig()
TOKEN = "train-test-token-0123456789abcdef"
WRONG = "train-test-token-fedcba9876543210"
BEYOND = ("tcp://*:0", "tcp://0.0.0.0:0")


pytestmark = pytest.mark.usefixtures("no_token")


@pytest.fixture
def core(beyond_loopback: str) -> Iterator[Core]:
    bind = f"tcp://{beyond_loopback}:0"
    c = Core(build_model(MC), MC, CoreConfig(bind=bind, token=TOKEN, admit_on_hello=True))
    try:
        yield c
    finally:
        c.close()


def test_default_binds_are_loopback() -> None:
    core_cli = build_parser().parse_args(["core"])
    assert core_cli.bind == CoreConfig().bind == "tcp://127.0.0.1:0"
    assert ParallelConfig().control_host == core_cli.control_host == "127.0.0.1"
    link = LeaderLink(ParallelConfig().control_host, 2, heartbeat_s=0.1)
    try:
        assert all(a.startswith("tcp://127.0.0.1:") for a in (link.addresses.work, link.addresses.fetch))
        assert link.addresses.beat.startswith("tcp://127.0.0.1:")
    finally:
        link.close()


@pytest.mark.parametrize("bind", BEYOND)
def test_core_bind_beyond_loopback_without_a_token_is_refused(bind: str) -> None:
    with pytest.raises(TokenRequiredError, match=rf"refusing to bind .* {TOKEN_ENV} .*CoreConfig.token"):
        Core(build_model(MC), MC, CoreConfig(bind=bind))


@pytest.mark.slow
def test_core_process_beyond_loopback_without_a_token_exits_naming_the_setting() -> None:
    env = env_without_token()
    argv = [sys.executable, "-m", "gyre_train.cli", "core", "--bind", "tcp://0.0.0.0:0", "--synthetic", "0"]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert p.returncode == 2, p.stderr
    assert f"refusing to bind tcp://0.0.0.0:0 beyond loopback without a token: set {TOKEN_ENV}" in p.stderr
    assert "--token-file" in p.stderr


def test_a_token_file_without_a_token_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "token"
    empty.write_text("\n")
    for cmd in (["core"], ["satellite", "--core", "tcp://127.0.0.1:1", "--name", "s"]):
        assert main([*cmd, "--token-file", str(empty)]) == 2
        assert f"the token file {empty} holds no token" in capsys.readouterr().err


def test_core_answers_token_holders_only(core: Core) -> None:
    good = CoreClient(core.address, timeout_s=10.0, token=TOKEN)
    try:
        assert good.status().version == core.version
        for token in ("", WRONG):
            bad = CoreClient(core.address, timeout_s=0.5, token=token)
            try:
                for _ in range(2):  # a second call after a refused handshake: an error again, not a hang
                    with pytest.raises(ControlError, match=r"did not answer within 0\.5 s"):
                        bad.status()
            finally:
                bad.close()
        assert good.status().replicas == ()  # still serving the holders; nobody else was heard
    finally:
        good.close()


def test_a_satellite_needs_the_token(core: Core) -> None:
    for token in ("", WRONG):
        cfg = SatelliteConfig(core.address, f"sat-{token or 'none'}", token=token, hello_timeout_s=1.0)
        with pytest.raises(CoreGoneError, match=r"did not answer within 1\.0 s"):
            Satellite(cfg)
    sat = Satellite(SatelliteConfig(core.address, "sat-0", token=TOKEN, hello_timeout_s=30.0))
    client = CoreClient(core.address, token=TOKEN)
    try:
        sat.pull(-1)  # through the core's publisher, which holds the token too
        status = client.status()
        assert sat.snapshot == status.snapshot >= 0
        assert [r.name for r in status.replicas] == ["sat-0"]
    finally:
        client.close()
        sat.close()


@pytest.mark.parametrize("bind_host", ["*", "0.0.0.0"])
def test_cell_link_beyond_loopback_without_a_token_is_refused(bind_host: str) -> None:
    with pytest.raises(TokenRequiredError, match=rf"{TOKEN_ENV} .*ParallelConfig.token"):
        LeaderLink(bind_host, 2, heartbeat_s=0.1)


def test_cell_link_hears_ranks_holding_the_token_only(beyond_loopback: str) -> None:
    leader = LeaderLink(beyond_loopback, 2, heartbeat_s=0.1, token=TOKEN)
    try:
        for token in ("", WRONG):
            intruder = FollowerLink(leader.addresses, 1, dead_after_s=600.0, token=token)
            try:
                with pytest.raises(RankSilentError, match=r"ranks \[1\] never connected"):
                    leader.wait_followers(0.5)
            finally:
                intruder.close()
        rank = FollowerLink(leader.addresses, 1, dead_after_s=600.0, token=TOKEN)
        try:
            leader.wait_followers(30.0)
            leader.command(Publish())
            got = rank.recv(30.0)
            assert got is not None and isinstance(got[0], Publish)
            rank.reply(RankReply(1))
            assert [r.rank for r in leader.replies(30.0)] == [1]
        finally:
            rank.close()
    finally:
        leader.close()
