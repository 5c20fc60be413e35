"""Launches a real SGLang server for an RL rollout cell and waits until it generates.

SGLang cannot run on this project's development machines (no CPU kernels on PyPI; see the README), so
what is tested here is the command line built from `SGLangConfig` and the readiness wait (against a
gyre-engine server, which answers /health_generate the same way). The flags are SGLang 0.5.x's.

The server gets the run token as SGLang's `--api-key` (the `api_key` setting, else `$GYRE_TOKEN`), which
makes it require `Authorization: Bearer <token>` on every path but its health probes; a host beyond
loopback without a token is refused (`gyre_base.token`), as gyre-engine's own server refuses it. SGLang
takes the key only on its command line (or in a `--config` file), so it shows in the host's process list.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

from gyre_base.token import listener_token

from gyre_engine.client import EngineClient


@dataclass(frozen=True)
class WeightGroup:
    """The trainer's NCCL group the server joins after start (for /update_weights_from_distributed)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "gyre_weights"
    backend: str = "nccl"


@dataclass(frozen=True)
class SGLangConfig:
    model_path: str
    """Model directory or hub name as SGLang takes it (`--model-path`)."""
    tp: int = 1
    """Tensor-parallel size (`--tp-size`)."""
    port: int = 30000
    host: str = "127.0.0.1"
    mem_fraction_static: float | None = None
    """Fraction of GPU memory for weights and KV (`--mem-fraction-static`); SGLang picks when None."""
    dp: int = 1
    """Data-parallel replicas inside the server (`--dp-size`)."""
    context_length: int | None = None
    max_running_requests: int | None = None
    served_model_name: str | None = None
    dtype: str | None = None
    random_seed: int | None = None
    weight_version: str | None = None
    """Initial weight_version SGLang reports (`--weight-version`)."""
    memory_saver: bool = True
    """`--enable-memory-saver`: needed for release/resume_memory_occupation to free anything."""
    weights_cpu_backup: bool = False
    """`--enable-weights-cpu-backup`: keep a host copy of the weights across a release."""
    skip_server_warmup: bool = False
    weight_group: WeightGroup | None = None
    python: str = field(default_factory=lambda: sys.executable)
    module: str = "sglang.launch_server"
    """What `python -m` runs: SGLang's server, or `gyre_engine.standin` (gyre-engine taking the same
    flags, SGLang's endpoints only) where SGLang cannot run."""
    extra_args: tuple[str, ...] = ()
    api_key: str = field(default="", repr=False)
    """The run token, passed as `--api-key` ("": `$GYRE_TOKEN`; none only on a loopback host)."""

    def token(self) -> str:
        """The key the server runs with ("" for none); TokenRequiredError beyond loopback without one."""
        return listener_token(self.host, self.api_key, "SGLangConfig.api_key")

    def command(self) -> list[str]:
        """The argv that launches this server (`python -m sglang.launch_server ...`)."""
        key = self.token()
        if self.tp < 1 or self.dp < 1:
            raise ValueError("tp and dp must be >= 1")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError("mem_fraction_static must be in (0, 1)")
        cmd = [self.python, "-m", self.module, "--model-path", self.model_path]
        cmd += ["--tp-size", str(self.tp), "--host", self.host, "--port", str(self.port)]
        if self.dp != 1:
            cmd += ["--dp-size", str(self.dp)]
        optional = {
            "--mem-fraction-static": self.mem_fraction_static,
            "--context-length": self.context_length,
            "--max-running-requests": self.max_running_requests,
            "--served-model-name": self.served_model_name,
            "--dtype": self.dtype,
            "--random-seed": self.random_seed,
            "--weight-version": self.weight_version,
        }
        for flag, value in optional.items():
            if value is not None:
                cmd += [flag, str(value)]
        if self.memory_saver:
            cmd.append("--enable-memory-saver")
        if self.weights_cpu_backup:
            cmd.append("--enable-weights-cpu-backup")
        if self.skip_server_warmup:
            cmd.append("--skip-server-warmup")
        if key:
            cmd += ["--api-key", key]
        return cmd + list(self.extra_args)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


async def wait_healthy(
    url: str,
    timeout_s: float,
    proc: subprocess.Popen[bytes] | None = None,
    poll_s: float = 1.0,
    *,
    api_key: str = "",
) -> None:
    """Poll `/health_generate` until it answers 200; TimeoutError after `timeout_s`, RuntimeError if
    `proc` exits first. (The probe needs no token on SGLang or gyre-engine; `api_key` is sent anyway.)"""
    deadline = time.monotonic() + timeout_s
    async with EngineClient(url, timeout_s=30.0, connect_timeout_s=2.0, api_key=api_key) as client:
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"server process exited with code {proc.returncode} before it was healthy")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{url} was not healthy within {timeout_s:.0f} s")
            if await client.health_generate(timeout=min(30.0, remaining)):
                return
            await asyncio.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))


@dataclass
class LaunchedServer:
    config: SGLangConfig
    process: subprocess.Popen[bytes]

    def stop(self, timeout_s: float = 30.0) -> int:
        """Terminate the server (SIGTERM, then SIGKILL after `timeout_s`); returns its exit code."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout_s)
        return int(self.process.returncode)


async def launch(
    config: SGLangConfig, timeout_s: float = 900.0, env: dict[str, str] | None = None
) -> LaunchedServer:
    """Start SGLang, wait for /health_generate, join the weight group if one is configured."""
    key = config.token()
    proc = subprocess.Popen(config.command(), env={**os.environ, **(env or {})})
    server = LaunchedServer(config, proc)
    try:
        await wait_healthy(config.url, timeout_s, proc, api_key=key)
        if config.weight_group is not None:
            g = config.weight_group
            async with EngineClient(config.url, api_key=key) as client:
                reply = await client.init_weights_update_group(
                    g.master_address, g.master_port, g.rank_offset, g.world_size, g.group_name, g.backend
                )
            if not reply.success:
                raise RuntimeError(f"init_weights_update_group failed: {reply.message}")
    except BaseException:
        server.stop()
        raise
    return server
