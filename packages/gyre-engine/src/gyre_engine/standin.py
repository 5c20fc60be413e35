"""gyre-engine in SGLang's place: `python -m gyre_engine.standin` takes the flags of
`python -m sglang.launch_server` that `launcher.SGLangConfig` writes and serves gyre-engine with SGLang's
endpoints only (`--sglang-only`: gyre's own endpoints answer 404, as on SGLang).

SGLang cannot serve on machines without a supported GPU; this lets the code that drives SGLang (its
launch line, readiness wait, distributed weight update, memory release and resume, pause and continue,
loads) run end to end against a real server there. `SGLangConfig(module="gyre_engine.standin", ...)`
selects it. Flags gyre-engine cannot honour are refused (several tensor- or data-parallel ranks, a
context length other than the model's, an initial weight version); those that only tune SGLang's memory
are accepted and have no effect: `--mem-fraction-static`, and `--enable-memory-saver` and
`--enable-weights-cpu-backup`, which describe what gyre-engine always does (release and resume always
work, and weights are kept on the host while released).
"""

from __future__ import annotations

import argparse
import sys


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gyre_engine.standin", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--random-seed", type=int, default=None)
    p.add_argument("--mem-fraction-static", type=float, default=None, help="accepted; no effect")
    p.add_argument("--context-length", type=int, default=None, help="refused: the model's own is used")
    p.add_argument("--weight-version", default=None, help="refused unless 0: gyre-engine starts at 0")
    p.add_argument("--enable-memory-saver", action="store_true", help="accepted; always on")
    p.add_argument("--enable-weights-cpu-backup", action="store_true", help="accepted; always on")
    p.add_argument("--skip-server-warmup", action="store_true", help="accepted; gyre-engine does not warm up")
    p.add_argument("--allow-remote", action="store_true", help="gyre-engine's: allow a non-loopback --host")
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    refused = [
        f"--tp-size {a.tp_size}" if a.tp_size != 1 else "",
        f"--dp-size {a.dp_size}" if a.dp_size != 1 else "",
        f"--context-length {a.context_length}" if a.context_length is not None else "",
        f"--weight-version {a.weight_version}" if a.weight_version not in (None, "0") else "",
    ]
    if any(refused):
        print(f"gyre_engine.standin: cannot honour {', '.join(r for r in refused if r)}", file=sys.stderr)
        return 2
    import torch

    from gyre_engine.server.engine import Engine
    from gyre_engine.server.serve import ServeConfig, serve

    if a.random_seed is not None:
        torch.manual_seed(a.random_seed)
    serve(
        ServeConfig(
            model=a.model_path,
            host=a.host,
            port=a.port,
            device=a.device,
            dtype=a.dtype,
            allow_remote=a.allow_remote,
            served_model_name=a.served_model_name,
            engine=Engine.Config(max_running_requests=a.max_running_requests),
            sglang_only=True,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
