"""A cell's engine when `[cell] engine = "sglang"`: an SGLang server started through gyre-engine's
launcher and driven only through SGLang's own endpoints.

`SGLangEngine.start()` runs the launcher's command line (`SGLangConfig.command()`, with the memory saver
on) as the cell's child, waits for `/health_generate` (`launcher.wait_healthy`), then forms a weight-update
group with it: the cell is rank 0 of gyre-train's `SGLangWeightSync` (NCCL on GPUs, gloo on the CPU),
the server joins through `/init_weights_update_group`. `load(publisher, snapshot, version)` pulls the
core's snapshot from gyre-xfer's publisher into this process (as satellites do) and broadcasts it to the
server through `/update_weights_from_distributed` inside a `/begin_weight_update` session, labelled with
the core's version. `release()` waits until the server is idle (the proxy drains it first, moving its
calls to other engines, where they are re-prefilled since SGLang has no KV hand-off; `/v1/loads` shows
when none is left), then pauses generation (`/pause_generation`) and frees its memory
(`/release_memory_occupation`); `resume()` takes the memory back
(`/resume_memory_occupation`). Weights released without a host copy are gone, so after a resume the next
`load` sends the whole model even if the version did not change, and only then does `continue_()` let
generation go on (`/continue_generation`).

`[cell] sglang_module` names what `python -m` runs: SGLang's `sglang.launch_server`, or, where SGLang
cannot serve (no supported GPU, as on the machines these tests run on), `gyre_engine.standin`: gyre-engine
taking the same flags and serving SGLang's endpoints only.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from gyre.cell.args import CellArgs
from gyre.procs.group import ProcessGroup

T = TypeVar("T")
log = logging.getLogger("gyre.sglang_cell")


class SGLangEngine:
    """One cell's SGLang server and the weight group the cell leads (module docstring)."""

    def __init__(self, a: CellArgs, procs: ProcessGroup) -> None:
        from gyre_engine.launcher import SGLangConfig

        self.a = a
        self.procs = procs
        remote = (
            ("--allow-remote",) if a.sglang_module == "gyre_engine.standin" and a.host != "127.0.0.1" else ()
        )
        self.config = SGLangConfig(
            model_path=a.model_dir,
            port=a.engine_port,
            host=a.host,
            memory_saver=True,
            module=a.sglang_module,
            extra_args=("--device", a.device, *remote),
        )
        self.url = self.config.url
        self.sync: Any = None  # gyre_train.engine_sync.SGLangWeightSync, once the group is formed
        self.sub: Any = None  # gyre_xfer Subscriber of the core's publisher
        self.loaded = 0
        """The version the server holds; -1 after a release (its weights are not kept)."""

    def _call(self, fn: Callable[[Any], Awaitable[T]], timeout_s: float = 120.0) -> T:
        from gyre_engine.client import EngineClient

        async def go() -> T:
            async with EngineClient(self.url, timeout_s=timeout_s) as c:
                return await fn(c)

        return asyncio.run(go())

    def start(self) -> None:
        from gyre_engine.launcher import wait_healthy
        from gyre_train.engine_sync import SGLangSyncConfig, SGLangWeightSync

        log.info("cell %d: starting %s", self.a.cell_id, shlex.join(self.config.command()))
        child = self.procs.start(
            f"engine-{self.a.cell_id}", self.config.command(), env={"OMP_NUM_THREADS": "1"}
        )
        asyncio.run(wait_healthy(self.url, self.a.startup_timeout_s, child.proc))
        self.sync = SGLangWeightSync(
            SGLangSyncConfig(
                engines=(self.url,),
                master_address=self.a.host,
                group_name=f"gyre-cell-{self.a.cell_id}",
                backend="nccl" if self.a.device == "cuda" else "gloo",
                push_at_start=False,
            )
        )
        self.sync.connect()

    def load(self, publisher: str, snapshot: int, version: int) -> float:
        """Pull snapshot >= `snapshot` from the core's publisher and broadcast it to the server, labelled
        `version`; returns the seconds the push took."""
        from gyre_xfer.subscriber import Subscriber, SubscriberConfig
        from gyre_xfer.transport import Config as XferConfig
        from gyre_xfer.transport import open_transport

        if self.sub is None:
            self.sub = Subscriber(
                open_transport(XferConfig(kind="shm")), SubscriberConfig(publisher=publisher)
            )
        snap = self.sub.pull(snapshot)
        report = self.sync.push(snap.torch(), version)
        self.loaded = version
        return float(report.seconds)

    def release(self, idle_timeout_s: float = 30.0) -> None:
        """Wait until the server is idle (the proxy drains it first; SGLang's /v1/loads says when), then
        pause and free its memory. A server still busy after `idle_timeout_s` is a TimeoutError."""
        deadline = time.monotonic() + idle_timeout_s
        while True:
            load = self._call(lambda c: c.load())
            if load.running == 0 and load.waiting == 0:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"cell {self.a.cell_id}: SGLang still has {load.running} running and {load.waiting} "
                    f"waiting requests {idle_timeout_s:.0f} s after the drain"
                )
            time.sleep(0.1)
        self._call(lambda c: c.pause("abort"))
        self._call(lambda c: c.release_memory(None))
        self.loaded = -1

    def resume(self) -> None:
        self._call(lambda c: c.resume_memory(None))

    def continue_(self) -> None:
        self._call(lambda c: c.continue_generation())

    def close(self) -> None:
        if self.sync is not None:
            sync, self.sync = self.sync, None
            sync.close()
        if self.sub is not None:
            sub, self.sub = self.sub, None
            sub.close()
