"""Time to push a model's weights to a `gyre-engine serve` process through SGLang's distributed weight
update (`SGLangWeightSync`, gloo on loopback): /begin_weight_update, /update_weights_from_distributed
with one broadcast per tensor, the engine's atomic copy into its model between two decode steps,
/end_weight_update. The trainer side holds the model directory's own weights (what is pushed does not
change the time). Medians of `--reps` pushes after one warm-up push.

    uv run python packages/gyre-train/bench/engine_push.py --shapes tiny:float32 qwen3-0.6b:bfloat16 \
        --out packages/gyre-train/bench/results-engine-push.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from gyre_base.ports import free_port
from gyre_train.engine_sync import SGLangSyncConfig, SGLangWeightSync


def serve(model_dir: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "gyre_engine", "serve", "--model", str(model_dir), "--port", str(port)]
    proc = subprocess.Popen(
        [*cmd, "--device", "cpu"], stdout=log.open("wb"), stderr=subprocess.STDOUT, env=dict(os.environ)
    )
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError("engine not ready in 600 s")
        time.sleep(0.5)


def case(shape: str, dtype: str, reps: int, root: Path) -> dict[str, object]:
    from transformers import AutoModelForCausalLM

    model_dir = root / f"{shape}-{dtype}"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "gyre_engine",
            "create-model",
            str(model_dir),
            "--shape",
            shape,
            "--dtype",
            dtype,
        ],
        check=True,
        capture_output=True,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    tensors = {n: p.data for n, p in model.named_parameters()}
    proc, url = serve(model_dir, root / f"{shape}.log")
    sync = SGLangWeightSync(SGLangSyncConfig((url,), group_name=f"bench-{shape}", timeout_s=600.0))
    try:
        t0 = time.perf_counter()
        sync.connect()
        connect_s = time.perf_counter() - t0
        sync.push(tensors, "warm-up")
        reports = [sync.push(tensors, str(i)) for i in range(reps)]
    finally:
        sync.close()
        proc.terminate()
        proc.wait(60)
    nbytes = reports[0].nbytes
    push_s = statistics.median(r.seconds for r in reports)
    bcast_s = statistics.median(r.broadcast_s for r in reports)
    return {
        "shape": shape,
        "dtype": dtype,
        "params": sum(p.numel() for p in model.parameters()),
        "tensors": reports[0].tensors,
        "bytes": nbytes,
        "connect_s": round(connect_s, 3),
        "push_s": round(push_s, 3),
        "broadcast_s": round(bcast_s, 3),
        "push_gb_per_s": round(nbytes / push_s / 1e9, 3),
        "push_s_all": [round(r.seconds, 3) for r in reports],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["tiny:float32", "qwen3-0.6b:bfloat16"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [case(*s.split(":"), a.reps, Path(tmp)) for s in a.shapes]
    out = {"cases": rows, "torch": torch.__version__, "cpus": os.cpu_count()}
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
