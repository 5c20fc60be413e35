"""One GPU benchmark call: `gyre run` with two cells sharing one H200, measured against its floors.

In one process, in order (each part's seconds land in the results as `phase_s`):
1. the model: `gyre-engine create-model` of the config's shape, then an optional short supervised warm
   start on the device (`--warmstart-steps`; gyre's warm-start transcripts of the built-in tasks, so the
   model emits calls the proxy parses and its scores vary: steps get a real gradient);
2. copy bandwidths (host<->device pinned and pageable, host memcpy) and the weight push path (gyre-xfer
   publish + pull of the model's own tensors) -> the floors (`gyre.measure.floors`, formula in its docstring);
3. gyre-engine standalone: `gyre-engine serve` with the run's engine options on the run's first GPU,
   `--concurrency` clients each sending calls of `--prompt-len` tokens and the run's max_tokens
   (temperature 1, EOS ignored) for `--engine-seconds`; output tokens/s and the start-up time;
4. gyre-train standalone: forward+backward tokens/s of a tree-packed fan (trunk + branches) on the same
   shape, FlexAttention on CUDA (gyre-train's bench `train_time`; no optimizer step);
5. `gyre run` of the config (`integration/examples/h200-shared.toml`);
6. `replay`: as many standalone engines as the run had, started together on its first GPU, each serving
   one run engine's recorded calls again (same inputs, output lengths and mean in-run concurrency, each
   execution's calls in order), all at once: `rollout_efficiency` = their wall seconds / the run's seconds
   with a call in flight (`replay.serve_run_again`). This, not part 3's tokens/s, is what the rollout goal
   holds the run to: part 3's calls are not the run's (a fixed prompt length, `max_tokens` every time);
then writes OUT/results-h200-run.json (every figure, the floors, the goals), OUT/timeline.png,
OUT/metrics.json and OUT/run-logs.tar.gz (the run's logs, the cells' records, steps.jsonl, the standalone
engines' logs).

    bash integration/bench/h200_run.sh                      # on the H200 (OUT set by the device call)
    uv run python integration/bench/h200_run.py --cpu --tiny --out /tmp/h200-cpu   # the same path, tiny
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import shutil
import statistics
import sys
import tarfile
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import replay
from gyre.config.runconfig import Config, load_config
from gyre.measure import floors
from gyre.procs.group import ProcessGroup, python_argv
from gyre.system import gpus
from gyre_base.ports import free_port

HERE = Path(__file__).resolve().parent
DEFAULT_CONFIG = HERE.parent / "examples" / "h200-shared.toml"
REPLAY_S = 90.0
"""Seconds the replay keeps of the call's budget when the run's deadline is cut to it: two engines'
start-up (about 35 s on the H200) and the run's calls served again."""


CALL_START_ENV = "GYRE_CALL_START"
"""The device call's start, wall-clock seconds since the epoch, as `h200_run.sh` exports it before it
installs the wheels and runs any CUDA tests: a script's `--budget-s` counts from it."""


def call_began(env: Mapping[str, str] = os.environ) -> float:
    """The monotonic time at which the device call began: `GYRE_CALL_START` where `h200_run.sh` set it
    (the wheels' install and the CUDA tests before the script count against the budget: a call whose
    tests took 70 s once ran past the device's wall limit), else now. Exits with a message where it is
    not seconds since the epoch, or lies in the future or more than an hour back."""
    now = time.monotonic()
    raw = env.get(CALL_START_ENV)
    if not raw:
        return now
    try:
        ago = time.time() - float(raw)
    except ValueError:
        raise SystemExit(f"{CALL_START_ENV}={raw!r}: not seconds since the epoch") from None
    if not -1.0 <= ago <= 3600.0:
        raise SystemExit(f"{CALL_START_ENV}={raw!r}: {ago:.0f} s ago, not within the last hour")
    if ago >= 1.0:
        say(f"the budget counts from the call's start, {ago:.0f} s before this script (wheels, CUDA tests)")
    return now - max(0.0, ago)


def tiny(cfg: Config, out_dir: str) -> Config:
    """The CPU variant: same sections and code path, the embedded tiny model, a short run."""
    r = dataclasses.replace
    return r(
        cfg,
        run=r(
            cfg.run,
            model_shape="tiny",
            model_dtype="float32",
            steps=3,
            deadline_s=400.0,
            out_dir=out_dir,
            startup_timeout_s=600.0,
        ),
        batch=r(cfg.batch, queries=2, group_size=2),
        agent=r(cfg.agent, max_tokens=12, turns=3, median_s=2.0, timeout_s=10.0),
        train=r(cfg.train, token_budget=4096),
        cell=r(cfg.cell, device="cpu", gpus=[], capacity=8),
        engine=r(cfg.engine, max_running=16),
        sched=r(cfg.sched, hold_s=0.5),
    )


def say(msg: str) -> None:
    print(f"[h200_run {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- 1. the model -----------------------------------------------------------------------------------
def create_model(cfg: Config, path: Path) -> Path:
    from gyre_engine.server.model_factory import create_model as make

    make(str(path), shape=cfg.run.model_shape, seed=cfg.run.seed, dtype=cfg.run.model_dtype)
    return path


def warm_start(
    model_dir: Path, device: str, steps: int, lr: float, max_tokens: int, seed: int
) -> dict[str, Any]:
    """Supervised fine-tune of `model_dir` in place on `device` (float32 master weights, bf16 autocast on
    CUDA) on gyre's warm-start transcripts (`gyre.rollout.warmstart`); the weights are written back in the
    model's dtype, under the same names."""
    import torch
    from gyre.rollout import warmstart
    from gyre_traj.loss import TorchBatch, target_logprobs
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    ws = warmstart.WarmStartConfig(seed=seed, steps=steps, batch=16, lr=lr, max_tokens=max_tokens)
    # Rendering a transcript takes milliseconds of CPU: a pool of at most 480, cycled through.
    data = warmstart.transcripts(
        warmstart.TranscriptMaker(model_dir, max_tokens), min(steps * ws.batch, 480), ws
    )
    t_data = time.perf_counter() - t0
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    cuda = device.startswith("cuda")
    losses = []
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / max(1, steps // 10))
        arrays = warmstart.pack_shared([data[(step * ws.batch + j) % len(data)] for j in range(ws.batch)])
        n = arrays["target_ids"].size

        def t(name: str, a: dict[str, Any] = arrays) -> Any:
            return torch.as_tensor(a[name], dtype=torch.long, device=device)

        z = torch.zeros(n, dtype=torch.float32, device=device)
        tb = TorchBatch(t("input_ids"), t("position_ids"), t("last_desc"), t("target_pos"), t("target_ids"),
                        z, z, z, torch.zeros(n, dtype=torch.long, device=device))  # fmt: skip
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            loss = -target_logprobs(model, tb).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
    state = model.state_dict()
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            names = list(st.keys())
            dtypes = {k: st.get_slice(k).get_dtype() for k in names}
        to = {"BF16": torch.bfloat16, "F16": torch.float16}
        save_file({k: state[k].detach().to(to.get(dtypes[k], torch.float32)).cpu().contiguous() for k in names},
                  str(f), metadata={"format": "pt"})  # fmt: skip
    del model, opt, state
    if cuda:
        torch.cuda.empty_cache()
    k = max(1, min(10, steps // 4))
    return {
        "steps": steps,
        "lr": lr,
        "transcripts_s": round(t_data, 2),
        "train_s": round(time.perf_counter() - t0 - t_data, 2),
        "loss_first": round(statistics.mean(losses[:k]), 4),
        "loss_last": round(statistics.mean(losses[-k:]), 4),
    }


# ---- 2. floors --------------------------------------------------------------------------------------
def bandwidths(model_dir: Path, device: str) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file

    wbytes = floors.weight_bytes(model_dir)
    copies = floors.measure_copies(device, wbytes)
    state: dict[str, Any] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        state.update({k: v.to(device) for k, v in load_file(str(f)).items()})
    xfer = floors.measure_xfer(state)
    del state
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"weight_bytes": wbytes, "copies": copies, "xfer": xfer, **floors.floors(wbytes, copies)}


# ---- 3. gyre-engine standalone ----------------------------------------------------------------------
def engine_standalone(cfg: Config, model_dir: Path, logs: Path, seconds: float, concurrency: int,
                      prompt_len: int, sweep: list[int]) -> dict[str, Any]:  # fmt: skip
    from gyre_engine.client import EngineClient
    from gyre_engine.protocol import SamplingParams

    procs = ProcessGroup(logs)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = python_argv("gyre_engine", "serve", "--model", str(model_dir), "--port", str(port),
                       "--device", cfg.cell.device, *gpus.engine_argv(cfg))  # fmt: skip
    t0 = time.monotonic()
    procs.start("engine-standalone", argv, env={"OMP_NUM_THREADS": "1", **gpus.cell_env(cfg, 0)})
    sampling = SamplingParams(max_new_tokens=cfg.agent.max_tokens, temperature=cfg.agent.temperature,
                              ignore_eos=True)  # fmt: skip

    async def healthy() -> float:
        async with EngineClient(url, timeout_s=10.0) as c:
            while True:
                procs.check()
                try:
                    if await c.health(timeout=5.0):
                        return time.monotonic() - t0
                except Exception:
                    pass
                if time.monotonic() - t0 > cfg.run.startup_timeout_s:
                    raise TimeoutError(f"standalone engine not healthy in {cfg.run.startup_timeout_s} s")
                await asyncio.sleep(0.3)

    async def client(c: Any, rng: random.Random, until: float, got: list[int]) -> None:
        while time.monotonic() < until:
            ids = [rng.randrange(10, 2000) for _ in range(prompt_len)]
            r = await c.generate(ids, sampling)
            got.append(len(r.output_ids))

    async def measure(c: Any, n: int, secs: float) -> tuple[list[int], float]:
        warm: list[int] = []
        await asyncio.gather(*(client(c, random.Random(i), time.monotonic() + 1.0, warm)
                               for i in range(n)))  # fmt: skip
        got: list[int] = []
        t1 = time.monotonic()
        await asyncio.gather(*(client(c, random.Random(100 + i), t1 + secs, got) for i in range(n)))
        return got, time.monotonic() - t1

    async def go() -> dict[str, Any]:
        up = await healthy()
        async with EngineClient(url, timeout_s=300.0) as c:
            got, wall = await measure(c, concurrency, seconds)
            by_conc: dict[str, float] = {}
            for n in sweep:  # tokens/s at lower concurrencies, to compare the run at its own
                g, w = await measure(c, n, max(2.0, seconds / 4))
                by_conc[str(n)] = round(sum(g) / w, 1)
        by_conc[str(concurrency)] = round(sum(got) / wall, 1)
        return {
            "startup_s": round(up, 2),
            "concurrency": concurrency,
            "prompt_len": prompt_len,
            "max_new_tokens": cfg.agent.max_tokens,
            "calls": len(got),
            "output_tokens": sum(got),
            "wall_s": round(wall, 3),
            "rollout_tok_s_standalone": round(sum(got) / wall, 1),
            "tok_s_by_concurrency": dict(sorted(by_conc.items(), key=lambda kv: int(kv[0]))),
        }

    try:
        return asyncio.run(go())
    finally:
        procs.close()


# ---- 4. gyre-train standalone -----------------------------------------------------------------------
def train_standalone(model_dir: Path, device: str, trunk: int, branches: int, branch: int) -> dict[str, Any]:
    import numpy as np
    import torch
    from gyre_train.bench.run import Fan, fan_tree, packs, train_time
    from gyre_train.model import build_model
    from gyre_train.modelconfig import ModelConfig
    from gyre_traj.loss import LossConfig

    mc = ModelConfig.from_model_dir(model_dir)
    attention = "flex" if device.startswith("cuda") else "dense"
    model = build_model(mc, attention, device)
    tree_b, _ = packs(fan_tree(Fan(trunk, branches, branch)), j_max=branches + 1)
    for b in tree_b:  # the fan's ids go up to 6,000: fold them into a small vocabulary
        np.remainder(b.input_ids, mc.vocab_size, out=b.input_ids)
        np.remainder(b.target_ids, mc.vocab_size, out=b.target_ids)
    tokens = sum(int(b.input_ids.size) for b in tree_b)
    cfg = LossConfig(mode="ppo")
    train_time(model, tree_b, attention, device, cfg)  # compile / warm up
    ts = [train_time(model, tree_b, attention, device, cfg) for _ in range(3)]
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    s = statistics.median(ts)
    return {"tokens": tokens, "fwd_bwd_s": round(s, 4), "train_tok_s_standalone": round(tokens / s, 1),
            "attention": attention}  # fmt: skip


# ---- 5. the run -------------------------------------------------------------------------------------
def output_tokens(records: Path) -> int:
    from gyre_traj.io import read_records
    from gyre_traj.records import Call

    if not records.exists():
        return 0
    return sum(int(r.output_ids.size) for r in read_records(records) if isinstance(r, Call))


def call_seconds(records: Path) -> float:
    """Seconds the recorded calls were open at the proxy, summed (over the busy rollout cell-seconds:
    the run's mean concurrency per busy engine)."""
    from gyre_traj.io import read_records
    from gyre_traj.records import Call

    if not records.exists():
        return 0.0
    return sum(max(0.0, r.t_end - r.t_start) for r in read_records(records) if isinstance(r, Call))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(DEFAULT_CONFIG))
    p.add_argument(
        "--policy", default="", help="override [run] policy (e.g. the two-GPU runs, one call each)"
    )
    p.add_argument("--out", default=os.environ.get("OUT", "h200-run-out"), help="results folder ($OUT)")
    p.add_argument("--work", default="", help="run directory (default: a folder beside --out's results)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU (with --tiny: this machine's test)")
    p.add_argument("--tiny", action="store_true", help="the embedded tiny model and a short run")
    p.add_argument("--warmstart-steps", type=int, default=None, help="default: 150 (GPU), 4 (--tiny)")
    p.add_argument("--warmstart-lr", type=float, default=None, help="default: 3e-4 (GPU), 3e-3 (--tiny)")
    p.add_argument("--engine-seconds", type=float, default=None, help="default: 20 (GPU), 4 (--tiny)")
    p.add_argument("--concurrency", type=int, default=0, help="standalone clients (default: the run's)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="the whole call's wall budget (default: 570 s, 1500 with --tiny): the run's deadline is cut "
        "so that the results are written within it",
    )
    p.add_argument(
        "--skip", default="", help="comma list of parts to skip: warmstart,floors,engine,train,replay"
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="SECTION.KEY=VALUE",
        help="override a key of the config, checked as the file is (e.g. train.token_budget=8192 to fit "
        "an 80 GB GPU); the results keep them under `overrides`",
    )
    a = p.parse_args()
    t_begin = call_began()
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(a.work or f"/tmp/h200-run-{os.getpid()}").resolve()
    work.mkdir(parents=True, exist_ok=True)
    cfg = load_config(a.config, a.overrides)
    if a.policy:
        cfg = cfg.with_policy(a.policy, cfg.run.out_dir)
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, out_dir=str(work / "run")))
    if a.tiny:
        cfg = tiny(cfg, str(work / "run"))
    if a.cpu:
        cfg = dataclasses.replace(cfg, cell=dataclasses.replace(cfg.cell, device="cpu", gpus=[]))
    device = "cuda" if cfg.cell.device == "cuda" else "cpu"
    if device == "cuda":  # this process measures on the run's first GPU
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus.cell_env(cfg, 0)["CUDA_VISIBLE_DEVICES"]
    skip = set(filter(None, a.skip.split(",")))
    small = a.tiny
    res: dict[str, Any] = {"config": a.config, "overrides": a.overrides, "tiny": small, "device": device,
                           "phase_s": {}, "errors": {}}  # fmt: skip
    res["machine"] = machine(device)
    say(f"device {device}; config {a.config}; work {work}; results {out}")

    def phase(name: str, fn: Any) -> Any:
        if name in skip:
            return None
        t0 = time.monotonic()
        say(f"{name} ...")
        try:
            return fn()
        except Exception as exc:  # one part failing still leaves the others' figures
            res["errors"][name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            return None
        finally:
            res["phase_s"][name] = round(time.monotonic() - t0, 2)
            say(f"{name} done in {res['phase_s'][name]} s")
            # after each part, so a call cut off at its limit still brings back what was measured
            (out / "results-h200-run.json").write_text(json.dumps(res, indent=1, default=str) + "\n")

    model_dir = phase("model", lambda: create_model(cfg, work / "model"))
    if model_dir is None:
        return finish(out, work, res, 1)
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, model_dir=str(model_dir)))
    steps = a.warmstart_steps if a.warmstart_steps is not None else (4 if small else 150)
    lr = a.warmstart_lr if a.warmstart_lr is not None else (3e-3 if small else 3e-4)
    if steps > 0:
        res["warmstart"] = phase("warmstart", lambda: warm_start(model_dir, device, steps, lr,
                                                                  cfg.agent.max_tokens, cfg.run.seed))  # fmt: skip
    fl = phase("floors", lambda: bandwidths(model_dir, device))
    if fl is not None:
        res["bandwidth"] = {"copies": fl["copies"], "xfer": fl["xfer"]}
        res.update({k: fl[k] for k in ("weight_bytes", "floor_to_training_s", "floor_to_rollout_s",
                                       "push_floor_s", "graph_recapture_s")})  # fmt: skip
    conc = a.concurrency or min(cfg.cell.capacity, cfg.batch.queries * cfg.batch.group_size)
    secs = a.engine_seconds if a.engine_seconds is not None else (4.0 if small else 20.0)
    sweep = [n for n in (1, 2, 4, 8, 16) if n < conc]
    eng = phase("engine", lambda: engine_standalone(cfg, model_dir, work / "standalone-logs", secs, conc,
                                                    a.prompt_len if not small else 32, sweep))  # fmt: skip
    if eng is not None:
        res["engine_standalone"] = eng
        res["rollout_tok_s_standalone"] = eng["rollout_tok_s_standalone"]
    fan = (64, 3, 32) if small else (512, 8, 256)
    tr = phase("train", lambda: train_standalone(model_dir, device, *fan))
    if tr is not None:
        res["train_standalone"] = tr
        res["train_tok_s_standalone"] = tr["train_tok_s_standalone"]
    from gyre.system.run import run

    # The run's deadline counts from its first batch: leave its start-up and teardown room in the budget,
    # and the replay's (its engines' start-up and the calls served again).
    budget = a.budget_s or (1500.0 if small else 570.0)
    left = budget - (time.monotonic() - t_begin) - 90.0 - (0.0 if "replay" in skip else REPLAY_S)
    if left < cfg.run.deadline_s:
        say(f"run deadline cut to {left:.0f} s to stay within --budget-s {budget:.0f}")
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, deadline_s=max(30.0, left)))
    res["run_deadline_s"] = cfg.run.deadline_s
    run_cfg = cfg
    metrics = phase("run", lambda: run(run_cfg, say=say))
    if metrics is not None:
        recs = Path(cfg.run.out_dir) / "records.msgpack"
        res.update(floors.run_figures(metrics, output_tokens(recs)))
        if res.get("rollout_busy_cell_s") and eng is not None:  # the standalone at the run's concurrency
            conc_in_run = call_seconds(recs) / res["rollout_busy_cell_s"]
            res["rollout_concurrency_in_run"] = round(conc_in_run, 2)
            res["rollout_tok_s_standalone_at_full_concurrency"] = eng["rollout_tok_s_standalone"]
            res["rollout_tok_s_standalone"] = floors.at_concurrency(eng["tok_s_by_concurrency"], conc_in_run)
        res["policy"] = metrics.get("policy")
        # how each engine spent its busy rollout seconds: decode, prefill passes, graph captures
        res["engine_time"] = (metrics.get("efficiency") or {}).get("engine_time")
        res["decisions"] = metrics.get("decisions")
    run_dir = Path(cfg.run.out_dir)
    if metrics is not None:
        until = t_begin + budget - 10.0
        rp = phase("replay", lambda: replay_run(cfg, model_dir, run_dir, metrics, work, until))
        if rp is not None:
            res["replay"] = rp
            res["rollout_efficiency"] = rp["rollout_efficiency"]
    if (run_dir / "logs").exists():  # also when the run failed: the cells logged every switch they made
        res["switch_parts"] = floors.switch_parts(run_dir / "logs")
    if metrics is None and (run_dir / "steps.jsonl").exists():
        res["steps_in_steps_jsonl"] = len((run_dir / "steps.jsonl").read_text().splitlines())
    res["goals"] = floors.against_goals(res)
    return finish(out, work, res, 0 if metrics is not None else 1)


def replay_run(
    cfg: Config, model_dir: Path, run_dir: Path, metrics: dict[str, Any], work: Path, until: float
) -> dict[str, Any]:
    """Part 6: the run's recorded calls served again by standalone engines, one per engine of the run, all
    started together; TimeoutError at `until` (time.monotonic)."""
    calls = replay.recorded_calls(run_dir / "records.msgpack")
    eng = replay.Engines(cfg, model_dir, work / "standalone-logs", len({c.engine for c in calls}))
    try:
        startup = eng.wait()
        out = replay.serve_run_again(cfg, eng.urls, calls, metrics, until)
    finally:
        eng.close()
    return {"standalone_startup_s": round(startup, 2), **out}


def machine(device: str) -> dict[str, Any]:
    import platform

    import torch

    m: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
    }
    if device == "cuda":
        m["gpu"] = torch.cuda.get_device_name(0)
        m["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return m


def finish(out: Path, work: Path, res: dict[str, Any], rc: int) -> int:
    run_dir = work / "run"
    (out / "results-h200-run.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    for name in ("timeline.png", "metrics.json"):
        if (run_dir / name).exists():
            shutil.copy(run_dir / name, out / name)
    with tarfile.open(out / "run-logs.tar.gz", "w:gz") as tar:
        for sub in ("run/logs", "run/cells", "run/steps.jsonl", "run/samples.jsonl", "run/train-samples.jsonl",
                    "standalone-logs", "model/config.json"):  # fmt: skip
            if (work / sub).exists():
                tar.add(work / sub, arcname=sub)
    say(
        f"results in {out / 'results-h200-run.json'}; goals {res.get('goals')}; errors {res['errors'] or 'none'}"
    )
    return rc


if __name__ == "__main__":
    sys.exit(main())
