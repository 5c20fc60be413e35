"""Shared fixtures: the tiny default model (created once per session), a transformers reference copy of
it in this process, and a real `gyre-engine serve` subprocess on a loopback port."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from gyre_base.testing import free_port

torch = pytest.importorskip("torch")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gyre_engine.server.model_factory import create_model

    return create_model(tmp_path_factory.mktemp("tiny") / "model", shape="tiny", seed=0)


@pytest.fixture(scope="session")
def hf_model(model_dir: Path) -> Any:
    return load_hf(model_dir)


def load_hf(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


class ServerProc:
    def __init__(
        self, model_dir: Path, log_path: Path, extra: tuple[str, ...] = (), wait: bool = True
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        cmd = [
            sys.executable,
            "-m",
            "gyre_engine",
            "serve",
            "--model",
            str(model_dir),
            "--port",
            str(self.port),
        ]
        cmd += ["--device", "cpu", "--max-running-requests", "16", *extra]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 300  # the machine is shared: imports alone can take minutes
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early: {self.log_path.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError("server did not become ready in 300 s")
            time.sleep(0.3)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(20)
        self.log.close()


@pytest.fixture(scope="module")
def spawn_server(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., ServerProc]]:
    """Start more `gyre-engine serve` processes (stopped at the end of the module using it)."""
    procs: list[ServerProc] = []

    def start(*extra: str, wait: bool = True) -> ServerProc:
        log = tmp_path_factory.mktemp("logs") / f"server{len(procs)}.log"
        procs.append(ServerProc(model_dir, log, extra, wait))
        return procs[-1]

    yield start
    for p in procs:
        p.stop()


@pytest.fixture(scope="session")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    srv = ServerProc(model_dir, tmp_path_factory.mktemp("logs") / "server.log")
    yield srv
    srv.stop()


def greedy_reference(model: Any, ids: list[int], n: int) -> list[int]:
    """transformers' own generate, greedy, EOS ignored."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(ids) :]]


@pytest.fixture(scope="session")
def greedy_of() -> Callable[[Path, list[int], int], list[int]]:
    """`greedy_of(model_dir, ids, n)`: transformers' greedy generate on the weights in `model_dir`."""
    return lambda model_dir, ids, n: greedy_reference(load_hf(model_dir), ids, n)


@pytest.fixture(scope="session")
def greedy(hf_model: Any) -> Callable[[list[int], int], list[int]]:
    """`greedy(ids, n)`: the reference continuation from transformers' generate on the original weights."""
    return lambda ids, n: greedy_reference(hf_model, ids, n)
