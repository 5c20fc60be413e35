"""Shared fixtures: start the peer process (tests/peer_proc.py) and always reap it (`beyond_loopback` and
`no_token` come from gyre-base's pytest plugin, the gate on tests marked `mooncake` from
`gyre_xfer.pytest_gate`)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from gyre_xfer.shm import sweep_orphans

PEER = Path(__file__).with_name("peer_proc.py")


class Peer:
    def __init__(self, role: str, kind: str, args: dict[str, object]) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), role, kind, json.dumps(args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(
                f"peer {role}/{kind} exited with {self.proc.wait(timeout=10)} before describing itself"
            )
        self.info = line

    def send(self, cmd: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()

    def readline(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        for f in (self.proc.stdout, self.proc.stdin):
            if f is not None and not f.closed:
                f.close()


@pytest.fixture
def spawn() -> Iterator[Callable[..., Peer]]:
    peers: list[Peer] = []

    def start(role: str, kind: str, **args: object) -> Peer:
        p = Peer(role, kind, args)
        peers.append(p)
        return p

    yield start
    for p in peers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.proc.pid, signal.SIGCONT)  # in case a test stopped it
        p.stop()
    sweep_orphans()  # segments of peers a test killed
