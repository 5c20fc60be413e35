"""`gyre eval CONFIG --checkpoint DIR`: the run's held-out evaluation, alone, on a HuggingFace model
directory (a checkpoint, or the model a run started from).

One gyre-engine server loads the checkpoint (`[cell] device`, `[engine]` options, as a run's cells do)
and a gyre-proxy in front of it renders with the checkpoint's tokenizer; then exactly what a run's
evaluator runs at each evaluation point (`rollout.evalset.evaluate_at`) scores the config's evaluation
split: `[eval] tasks` tasks chosen by `[eval] seed` (your `[tasks]` evaluation rows: all of them when
`[eval] tasks` is 0), greedy, `[eval] max_tokens`. The summary is the run's `evals.jsonl` line with
`checkpoint` added (version 0: the checkpoint as loaded), appended to `OUT/evals.jsonl`; the engine's
and proxy's logs are in `OUT/logs`. Both processes are stopped at the end, also after an error.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from gyre_base.ports import free_port

from gyre.config.runconfig import Config, ConfigError
from gyre.procs.group import ProcessGroup, python_argv
from gyre.rollout.evalset import EVALS, append_result, eval_set_of, evaluate_at
from gyre.system import gpus

ALL = 1 << 62
"""`[eval] tasks` = 0 with your own rows: every row of the evaluation split."""


class EvalError(RuntimeError):
    """The evaluation could not run (a part did not come up); the message says which."""


def evaluate_checkpoint(
    cfg: Config, checkpoint: Path, out: Path, say: Callable[[str], None] = print
) -> dict[str, Any]:
    """Score `checkpoint` on `cfg`'s evaluation split (module docstring); the summary, also appended to
    `out/evals.jsonl`. A checkpoint that is not a model directory, or no evaluation split, is a
    `ConfigError`; a part that does not come up is an `EvalError`."""
    if not (checkpoint / "config.json").is_file():
        raise ConfigError(f"--checkpoint {checkpoint}: not a HuggingFace model directory (no config.json)")
    if cfg.tasks.train:
        if not (cfg.tasks.eval or cfg.tasks.eval_fraction):
            raise ConfigError("gyre eval: no evaluation split: set [tasks] eval or [tasks] eval_fraction")
        n = cfg.eval.tasks or ALL
    elif cfg.eval.tasks:
        n = cfg.eval.tasks
    else:
        raise ConfigError("gyre eval: [eval] tasks is 0: say how many held-out tasks, e.g. eval.tasks=32")
    evals = eval_set_of(cfg, n)
    out.mkdir(parents=True, exist_ok=True)
    procs = ProcessGroup(out / "logs")
    try:
        proxy = _serve(cfg, checkpoint, procs)
        say(f"gyre eval: {checkpoint} on {len(evals.tasks)} tasks through {proxy}")
        result = asyncio.run(
            evaluate_at(evals, 0, proxy, cfg.agent, cfg.eval.max_tokens, lambda _: None, lambda _, __: None)
        )
    finally:
        procs.close()
    result["checkpoint"] = str(checkpoint)
    append_result(out / EVALS, result)
    return result


def _serve(cfg: Config, checkpoint: Path, procs: ProcessGroup) -> str:
    """An engine on `checkpoint` and a proxy routing to it, both up; the proxy's URL."""
    engine = f"http://127.0.0.1:{free_port()}"
    proxy = f"http://127.0.0.1:{free_port()}"
    procs.start(
        "engine",
        python_argv(
            "gyre_engine", "serve", "--model", str(checkpoint), "--port", engine.rsplit(":", 1)[1],
            "--device", cfg.cell.device, *gpus.engine_argv(cfg),
        ),
        env=gpus.cell_env(cfg, 0),
    )  # fmt: skip
    procs.start(
        "proxy",
        python_argv(
            "gyre_proxy.cli", "serve", "--tokenizer", str(checkpoint), "--engine", engine,
            "--port", proxy.rsplit(":", 1)[1],
        ),
    )  # fmt: skip
    deadline = time.monotonic() + cfg.run.startup_timeout_s
    for what, url in (("gyre-engine", engine), ("gyre-proxy", proxy)):
        while not _up(f"{url}/health"):
            procs.check()  # a child that died is a ChildDied naming it and its log's tail
            if time.monotonic() > deadline:
                raise EvalError(
                    f"{what} not up within {cfg.run.startup_timeout_s:.0f} s ([run] startup_timeout_s); "
                    f"see {procs.log_dir}"
                )
            time.sleep(0.2)
    return proxy


def _up(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False
