"""The report-shaped workload on one H200, one device call per policy (or several policies in one call):
`gyre run` of `integration/examples/h200-agentic.toml` (the profile harness: long agent contexts, outputs
of hundreds of tokens, tool time, compaction, sub-agents, a heavy tail ending at the timeout), measured
against what the same machine does alone with the same work.

In one process, in order (each part's seconds land in the results as `phase_s`):
1. the model: `gyre-engine create-model` of the config's shape, and a short supervised warm start
   (`h200_run.warm_start`);
2. the floors: copy bandwidths and the weight push path (`h200_run.bandwidths`);
3. per policy, `gyre run` (its metrics.json, timeline and efficiency entry kept per policy);
4. `train` (first policy only): a core alone trains the run's kept steps again:
   `train_efficiency` = its seconds / the run's busy training GPU-seconds (the first step counts);
5. `alone`: two standalone engines on the run's GPU, started once, for
   - `replay` (first policy only): each engine's recorded calls served again by one of them, both at
     once as in the run, with their inputs and output lengths, at that engine's mean in-run
     concurrency: `rollout_efficiency` = their wall seconds / the run's seconds with a call in flight
     (`rollout_efficiency_sampled` holds them to the sampled busy rollout GPU-seconds);
   - `migrate`: a moved call's time to first token with its 16k-token prefix handed over (gyre-xfer,
     shared memory) against the same call prefilled again;
   - `probe`: two more engines, the slots' columns sized by length bucket and by the whole buffer
     (`--slot-widths`), each alone in turn at its full batch on fresh contexts of 1k-14k tokens: prefill
     seconds, then seconds per decode step continuing them from the prefix cache, with the engine's own
     decode seconds and the CUDA graphs it captured meanwhile (`decode_vs_context`).
   With `replay` skipped this part runs first, before the policies.
6. `sim`: the gyre-sched simulator predicts every policy measured (this call's runs and the metrics.json
   of earlier calls given with `--reuse`) on the same workload, calibrated on all of them as `gyre compare
   --reuse` does: per policy `sim_end_to_end_s` and `sim_ratio` (measured / simulated), and the ratios
   against elastic measured and simulated, each held to within 15%.
A part that dies fails its run at once (`[survive] restart` off), naming it with its log's last lines; on
SIGTERM (the call's wall limit) the runs' logs go to OUT before the bench stops.

Where the lone trainer or the replay of the first policy's finished run is skipped (`--skip`, or for
want of the call's time), that run goes to OUT as archives (`runarchive`: `run-<policy>.tar.xz`, its
metrics and record log, and `run-<policy>-batches-<k>.tar.xz`, its kept steps; names and sizes under
`run_archives`), and a later call measures them with `--from-run` and those archives (copied into the
working tree, in an ignored folder the call carries), with no run of its own:

    bash integration/bench/h200_run.sh --script h200_agentic.py --policies elastic \
        --skip probe,migrate,replay,train
    bash integration/bench/h200_run.sh --script h200_agentic.py --skip probe,migrate \
        --from-run .runs/run-elastic.tar.xz,.runs/run-elastic-batches-0.tar.xz
Results go to OUT/results-h200-agentic.json (every figure, per policy, and the goals it is held to), the
timelines to OUT/timeline-<policy>.png, each run's metrics.json to OUT/metrics-<policy>.json.

Before anything runs, the call's phases are printed with seconds estimated from an earlier call's results
(`--plan-from`, default the committed results of bench/, the latest measurement of each part; a policy
not run there scaled from elastic's run by the simulator; with config overrides, every run from the
simulator's end to end for the overridden config, calibrated on each policy's newest complete run in
bench/), their sum against the 600 s of one call, and the first run's deadline (the budget less what
precedes it, counted from the call's start: a run past its deadline fails and leaves no figures, so the
parts after the runs give way: each is skipped, saying so under `skipped`, where the runs left it less
than its planned seconds), with a warning where the simulated end to end is past it; `--plan` prints only
that. With the committed figures a run takes
about 510 s of a call (the model, the warm start, the floors, the run to its deadline) and measuring it
(`--from-run`: the lone trainer and the replay of its 1,200 calls) about 440 s, so the workload takes four
calls: elastic; its measurement; colocate; async. The later calls reuse the earlier runs' metrics.json
(OUT/metrics-<policy>.json copied into `.runs/`, the ignored folder the calls carry, beside the run
archives) so the simulator and the goals across policies see all three. Calls made back to back on one
machine kept warm can share the warm-started model (`--model-cache .model-cache`, an ignored folder of the
working tree that outlives a call there: the later calls skip the model and the warm start, about 50 s):

    bash integration/bench/h200_run.sh --script h200_agentic.py --policies elastic --skip probe,migrate,replay,train
    bash integration/bench/h200_run.sh --script h200_agentic.py --skip probe,migrate,floors --warmstart-steps 0 \
        --from-run .runs/run-elastic.tar.xz,.runs/run-elastic-batches-0.tar.xz
    bash integration/bench/h200_run.sh --script h200_agentic.py --policies colocate --skip replay,train \
        --reuse .runs/metrics-elastic.json
    bash integration/bench/h200_run.sh --script h200_agentic.py --policies async \
        --skip replay,migrate,probe,train --reuse .runs/metrics-elastic.json,.runs/metrics-colocate.json
    uv run python integration/bench/h200_agentic.py --cpu --tiny --policies elastic,colocate,async \
        --out /tmp/agentic-cpu   # the same path, tiny (about 4 minutes on 2 cores)

Keys of the config can be overridden after the options (`SECTION.KEY=VALUE`, checked as the file is; the
results keep them under `overrides`), e.g. a timeout that cuts only the tail of this load, one batch
ahead (`bench/sim_settings.py` says where the policies part):

    bash integration/bench/h200_run.sh --script h200_agentic.py --policies elastic \
        --skip probe,migrate,replay,train agent.timeout_s=150 driver.max_ahead=1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import statistics
import sys
import tarfile
import time
import traceback
from pathlib import Path
from typing import Any

import h200_run
import model_cache
import replay
import runarchive
from gyre.config.runconfig import Config, ConfigError, load_config
from gyre.measure import arms, floors
from gyre.system import gpus

HERE = Path(__file__).resolve().parent
DEFAULT_CONFIG = HERE.parent / "examples" / "h200-agentic.toml"
RESULTS = "results-h200-agentic.json"
PLAN_FROM = (
    RESULTS,
    "results-h200-agentic-from-run.json",
    "results-h200-agentic-fixes.json",
    "results-h200-agentic-fixes-from-run.json",
    "results-h200-agentic-1205.json",
    "results-h200-agentic-1205-from-run.json",
    "results-h200-agentic-compare-elastic.json",
    "results-h200-agentic-compare-colocate.json",
    "results-h200-agentic-1206-elastic.json",
    "results-h200-agentic-1206-colocate.json",
    "results-h200-agentic-1206-async.json",
    "results-h200-agentic-probe.json",
)
"""The committed results the plan's estimates come from by default: the calls', oldest first, then the
probe call's."""
CALL_LIMIT_S = 600.0
"""One device call's wall limit: the phases of a call have to fit in it (`plan`)."""
STARTUP_S = 60.0
"""Seconds a run's start-up takes before its `[run] deadline_s` starts counting (engines, trainer warm-up,
registration; 41-47 s measured on the H200 for the example once the warm-ups compiled nothing), allowed
for when the deadline is cut to the call's budget."""
AFTER_RUN_S = 30.0
"""Seconds kept after a run's deadline when it is cut to the call's budget: its shutdown, its figures and
archives, the simulator. (On the H200 a run stopped at its deadline ended within the second and its
archives took 6 s; 60 s were kept before, which left a 4-step run less time than it needed.)"""


def tiny(cfg: Config, out_dir: str) -> Config:
    """The CPU variant: the same sections and code path, the tiny model, the CPU profile's sizes."""
    r = dataclasses.replace
    cpu = load_config(HERE.parent / "examples" / "profile-cpu.toml")
    return r(
        cfg,
        run=r(
            cfg.run,
            model_shape="tiny",
            model_dtype="float32",
            steps=2,
            deadline_s=600.0,
            out_dir=out_dir,
            startup_timeout_s=600.0,
        ),
        batch=r(cfg.batch, queries=2, group_size=2),
        agent=r(cpu.agent),
        profile=cpu.profile,
        train=r(
            cfg.train, token_budget=4096, chunk_budget=256
        ),  # paths past 256 tokens train chunked, as on the GPU
        cell=r(cfg.cell, device="cpu", gpus=[], capacity=8),
        engine=r(cfg.engine, max_running=16),
        sched=r(cfg.sched, hold_s=0.5),
    )


def say(msg: str) -> None:
    print(f"[h200_agentic {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def alone_phase(
    cfg: Config,
    model_dir: Path,
    run_dir: Path | None,
    metrics: dict[str, Any] | None,
    logs: Path,
    contexts: list[int],
    skip: set[str],
    deadline: float,
) -> dict[str, Any]:
    """Two standalone engines on the run's GPU, started once: `replay` (each engine of the run has its
    recorded calls served again by one of them, both at once, as the two shared the GPU in the run), then
    `migrate` (a moved call's first token with its prefix handed over, against prefilled again)."""
    out: dict[str, Any] = {}
    vocab = min(json.loads((model_dir / "config.json").read_text())["vocab_size"], 2000)
    replaying = run_dir is not None and metrics is not None and "replay" not in skip
    if replaying or "migrate" not in skip:
        eng = replay.Engines(cfg, model_dir, logs, 2)
        try:
            out["standalone_startup_s"] = round(eng.wait(), 2)
            if replaying:
                assert run_dir is not None and metrics is not None
                calls = replay.recorded_calls(run_dir / "records.msgpack")
                out["replay"] = replay.serve_run_again(cfg, eng.urls, calls, metrics, deadline)
            if "migrate" not in skip:
                out["migrate"] = replay.bounded(
                    replay.migration_vs_reprefill(eng.urls[0], eng.urls[1], contexts, 4, vocab), deadline
                )
        finally:
            eng.close()
    if "probe" not in skip:  # one engine per way of sizing the decode step's columns, one after the other
        out["probe_startup_s"], out["decode_vs_context"] = {}, {}
        lengths = [256, 1024] if contexts[0] < 1024 else [1024, 4096, 8192, 14336]
        for w in ["bucketed", "full"]:
            probe = replay.Engines(cfg, model_dir, logs, 1, [["--slot-widths", w]], name=f"probe-{w}")
            try:
                out["probe_startup_s"][w] = round(probe.wait(), 2)
                out["decode_vs_context"][w] = replay.bounded(
                    replay.decode_vs_context(probe.urls[0], lengths, cfg.engine.max_running, 64, vocab),
                    deadline,
                )
            except TimeoutError:  # the other width's figures are kept
                out["decode_vs_context"][w] = {"error": "not done within the call's budget"}
            finally:
                probe.close()
    return out


def train_phase(
    cfg: Config, model_dir: Path, run_dir: Path, metrics: dict[str, Any], device: str
) -> dict[str, Any]:
    r = replay.train_again(
        model_dir, run_dir / "batches", device, cfg.train.token_budget, cfg.train.lr, cfg.train.chunk_budget
    )
    busy = metrics.get("efficiency", {}).get("device_seconds", {}).get("training_busy_s")
    return {
        **r,
        "training_busy_gpu_s": busy,
        "training_busy_cell_s": metrics.get("roles", {}).get("cell_seconds", {}).get("training_busy_s"),
        "train_efficiency": round(r["total_s"] / busy, 4) if busy else None,
        "run_partial": metrics.get("partial"),  # a run cut at its deadline: its applied steps only
    }


def policy_figures(metrics: dict[str, Any], records: Path) -> dict[str, Any]:
    """The run's figures (`floors.run_figures`: with the first step's training seconds and the later
    steps' median) with its efficiency entry."""
    out = floors.run_figures(metrics, h200_run.output_tokens(records))
    eff = metrics.get("efficiency", {})
    out.update(
        engine_call_share=eff.get("engine_call_share"),
        prefix_cache_hit_share=eff.get("prefix_cache_hit_share"),
        prefix_cache_hit_share_ideal=eff.get("prefix_cache_hit_share_ideal"),
        prefix_cache=eff.get("prefix_cache"),
        context_tokens_max=eff.get("context_tokens_max"),
        engine_startup_s=eff.get("startup", {}).get("engine_startup_s"),
        engines_started_together=eff.get("startup", {}).get("engines_started_together"),
        device_seconds=eff.get("device_seconds"),
        engine_time=eff.get("engine_time"),
        timeouts=metrics.get("timeouts"),
        executions=metrics.get("executions"),
        moves=metrics.get("moves"),
        run_end_s=metrics.get("end_s"),  # the run's end after its last step, part by part
    )
    out["not_measured"] = not_measured(out)
    return out


def not_measured(f: dict[str, Any]) -> dict[str, str]:
    """Why a figure of a policy's run is absent, where the run had nothing to measure (not a failure)."""
    why: dict[str, str] = {}
    for to in ("training", "rollout"):
        if not f.get(f"switches_to_{to}"):
            why[f"switch_to_{to}_s"] = f"no switch to {to} in this run (its policy keeps the cells' roles)"
    if not any(v is not None for v in (f.get("push_s") or {}).values()):
        why["push_s"] = (
            "no engine was serving rollout when a version was applied: each got it in its switch back "
            "to rollout (switch_to_rollout_s)"
        )
    if len(f.get("engine_call_share") or {}) < 2:
        why["engine_call_share"] = "fewer than two engines served rollout at once"
    return why


def sim_phase(cfg: Config, measured: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The simulator's prediction of every policy measured (this call's runs and the `--reuse`d ones'
    metrics.json) for this workload, calibrated on all of them as `gyre compare --reuse` does, and each
    measured end to end (and ratio against elastic) held to it (`arms.against_prediction`)."""
    from gyre.scenarios.compare import predicted

    order = sorted(measured, key=lambda p: p != "elastic")  # ratios against elastic, where it ran
    configs = {p: cfg.with_policy(p, cfg.run.out_dir) for p in order}
    table = predicted(cfg, configs, {p: [measured[p]] for p in order})
    return {
        **arms.against_prediction(table),
        "steps_planned": cfg.run.steps,
        "steps_applied": {p: measured[p].get("steps_applied") for p in order},
        "calibration": table["calibration"],
        "predicted": {r["arm"]: r["predicted"] for r in table["rows"]},
    }


def estimates(
    results: dict[str, Any], probe: dict[str, Any] | None, sim: dict[str, Any] | None, changed: bool = False
) -> dict[str, float]:
    """Seconds per part of a call, from an earlier call's results (its `phase_s` and parts) and a probe
    call's: `alone` split into the standalone engines' start-up, `replay`, `migrate` and one `probe` width;
    a policy not run there scaled from elastic's run by the simulator (`sim`: `sim_phase` of the runs, on
    this call's config). With the config `changed` from the runs' (overrides), every run is the
    simulator's end to end for this config plus the start and end elastic's run measured: a run measured
    at another timeout says little of this one's length."""
    ph = results.get("phase_s", {})
    est = {
        k: float(v)
        for k, v in ph.items()
        if k in ("model", "warmstart", "floors", "train") or k.startswith("run-")
    }
    start = float(results.get("standalone_startup_s") or 40.0)
    replay_s = float((results.get("replay") or {}).get("standalone_s") or 0.0)
    est["alone-startup"] = start
    est["replay"] = replay_s
    est["migrate"] = max(0.0, float(ph.get("alone", start)) - start - replay_s)
    if probe is not None:  # one width: its engine's start-up and its probe (the probe call also migrated)
        pph = probe.get("phase_s", {})
        pstart = float(probe.get("standalone_startup_s") or start)
        est["probe"] = pstart + max(0.0, float(pph.get("alone", pstart)) - pstart - est["migrate"])
    run_e = est.get("run-elastic")
    e2e = (results.get("policies", {}).get("elastic") or {}).get("end_to_end_s")
    if sim and run_e is not None and e2e:
        sims = {p: a["sim_end_to_end_s"] for p, a in sim.get("arms", {}).items()}
        for p, v in sims.items():  # the run's start and end as elastic's, its end to end as simulated
            est[f"sim-{p}"] = round(v, 1)  # the end to end alone, held to the run's deadline by the plan
            if changed:
                est[f"run-{p}"] = round(run_e - e2e + v, 1)
            elif f"run-{p}" not in est and sims.get("elastic"):
                est[f"run-{p}"] = round(run_e - e2e + e2e * v / sims["elastic"], 1)
    return est


def merged_results(found: list[dict[str, Any]]) -> dict[str, Any]:
    """Earlier calls' results, oldest first, as one: each phase's seconds, the standalone engines'
    start-up and the replay from the latest call that measured them, the policies' figures merged the
    same way. A phase that failed (a run past its deadline, a replay the call's time cut short) took at
    least its seconds: it raises the estimate, never lowers it."""
    out: dict[str, Any] = {"phase_s": {}, "policies": {}}
    for r in found:
        failed = set(r.get("errors") or {})
        for k, v in (r.get("phase_s") or {}).items():
            before = out["phase_s"].get(k)
            out["phase_s"][k] = max(v, before) if k in failed and before is not None else v
        for key in ("standalone_startup_s", "replay"):
            if r.get(key):
                out[key] = r[key]
        for pol, figs in (r.get("policies") or {}).items():
            out["policies"][pol] = {**out["policies"].get(pol, {}), **figs}
    return out


def newest_runs(folder: Path, steps: int) -> dict[str, dict[str, Any]]:
    """Per policy, the metrics of its newest run in `folder` (`metrics-h200-agentic*.json`, by the run's
    start) that applied all `steps`: what the plan calibrates the simulator on."""
    out: dict[str, dict[str, Any]] = {}
    for f in folder.glob("metrics-h200-agentic*.json"):
        m = json.loads(f.read_text())
        if m.get("steps_applied") != steps or "policy" not in m:
            continue
        if m["policy"] not in out or float(m.get("t0", 0.0)) > float(out[m["policy"]].get("t0", 0.0)):
            out[m["policy"]] = m
    return out


def plan_estimates(
    paths: str, cfg: Config, reused: dict[str, dict[str, Any]], changed: bool = False
) -> dict[str, float]:
    """`estimates` from the results files `paths` (earlier calls', oldest first, and a probe call's, named
    `*probe*`; a missing one is left out), with the simulator on `cfg` (the device workload, also for a
    tiny run, with this call's overrides: `changed`) calibrated on the reused runs (else each policy's
    newest complete run beside the first results, `newest_runs`)."""
    files = [Path(x) for x in paths.split(",") if x and Path(x).exists()]
    calls = [f for f in files if "probe" not in f.name]
    probes = [f for f in files if "probe" in f.name]
    if not calls:
        return {}
    results = merged_results([json.loads(f.read_text()) for f in calls])
    probe = json.loads(probes[-1].read_text()) if probes else None
    runs = dict(reused) or newest_runs(calls[0].parent, cfg.run.steps)
    sim = None
    if "elastic" in runs:
        base = runs["elastic"]
        try:  # every policy predicted, calibrated on the runs there are (elastic's for the others)
            sim = sim_phase(
                cfg, {p: runs.get(p, {**base, "policy": p}) for p in ("elastic", "colocate", "async")}
            )
        except Exception as exc:  # the estimates are advice: a run goes on without them
            say(f"plan: no simulated estimates ({type(exc).__name__}: {exc})")
    return estimates(results, probe, sim, changed)


def plan(
    policies: list[str], skip: set[str], est: dict[str, float], from_run: bool = False
) -> list[tuple[str, float | None]]:
    """The phases one call runs (`--policies`, `--skip`; `from_run`: an earlier call's run measured instead
    of a run) in order, each with its estimated seconds (None: no estimate), as `main` runs them."""
    out: list[tuple[str, float | None]] = [("model", est.get("model"))]
    for name in ("warmstart", "floors"):
        if name not in skip:
            out.append((name, est.get(name)))
    alone = [p for p in ("replay", "migrate", "probe") if p not in skip]
    parts = [("alone-startup", est.get("alone-startup"))] if {"replay", "migrate"} & set(alone) else []
    parts += [(p, est.get(p) if p != "probe" else 2 * est.get("probe", 0.0) or None) for p in alone]
    if alone and "replay" not in alone:
        out += parts
    out += [(f"run-{p}", est.get(f"run-{p}")) for p in ([] if "run" in skip else policies)]
    if (from_run or (policies and "run" not in skip)) and "train" not in skip:
        out.append(("train", est.get("train")))
    if alone and "replay" in alone:
        out += parts
    return out


def reserve_after_run(planned: dict[str, float | None]) -> dict[str, float]:
    """Seconds each part that can follow the runs needs (the lone trainer, the standalone engines' parts):
    as `planned` from an earlier call's figures (a device run), else a default per part."""
    default = {"train": 60.0, "alone-startup": 40.0, "replay": 150.0, "migrate": 30.0, "probe": 120.0}
    return {n: planned.get(n) or d for n, d in default.items()}


def goals(res: dict[str, Any]) -> dict[str, Any]:
    """The goals this workload is held to, per policy where they differ (None where a figure is missing)."""

    def le(x: Any, bound: Any) -> bool | None:
        return None if x is None or bound is None else bool(x <= bound)

    out: dict[str, Any] = {}
    ft, fr, pf = res.get("floor_to_training_s"), res.get("floor_to_rollout_s"), res.get("push_floor_s")
    for pol, p in res.get("policies", {}).items():
        share = p.get("engine_call_share") or {}
        pushes = [v for v in (p.get("push_s") or {}).values() if v is not None]
        out[pol] = {
            "engine_call_share_40_60": None
            if len(share) < 2
            else all(0.4 <= v <= 0.6 for v in share.values()),
            "prefix_cache_hit_share_0_9": None
            if p.get("prefix_cache_hit_share") is None
            else p["prefix_cache_hit_share"] >= 0.9,
            "prefix_cache_hit_share_0_95_of_ideal": None
            if not p.get("prefix_cache_hit_share") or not p.get("prefix_cache_hit_share_ideal")
            else p["prefix_cache_hit_share"] >= 0.95 * p["prefix_cache_hit_share_ideal"],
            "switch_to_training_2x_floor_plus_1s": le(p.get("switch_to_training_s"), ft and 2 * ft + 1.0),
            "switch_to_rollout_2x_floor_plus_1s": le(p.get("switch_to_rollout_s"), fr and 2 * fr + 1.0),
            "push_2x_floor_plus_0_5s": None
            if not pushes or pf is None
            else statistics.median(pushes) <= 2 * pf + 0.5,
            "engine_startup_60s": None
            if not p.get("engine_startup_s")
            else max(p["engine_startup_s"]) <= 60.0,
            "engines_started_together": p.get("engines_started_together"),
            "end_to_end_within_15pct_of_sim": sim_goal(res, pol),
        }
    for pol in res.get("reused", {}):  # an earlier call's run, held to the prediction calibrated on all
        if pol not in out:
            out[pol] = {"reused": True, "end_to_end_within_15pct_of_sim": sim_goal(res, pol)}
    rp, tp, mg = res.get("replay"), res.get("train_again"), res.get("migrate")
    out["rollout_efficiency_0_7"] = (
        None if not rp or rp.get("rollout_efficiency") is None else rp["rollout_efficiency"] >= 0.7
    )
    out["train_efficiency_0_7"] = (
        None if not tp or tp.get("train_efficiency") is None else tp["train_efficiency"] >= 0.7
    )
    out["migration_3x_faster"] = None if not mg else all(v["speedup"] >= 3.0 for v in mg.values())
    e2e = {k: v.get("end_to_end_s") for k, v in {**res.get("reused", {}), **res.get("policies", {})}.items()}
    if {"elastic", "colocate", "async"} <= e2e.keys() and all(e2e.values()):
        out["elastic_ahead_of_both"] = e2e["elastic"] < min(e2e["colocate"], e2e["async"])
    sim = res.get("sim") or {}
    out["ratios_within_15pct_of_sim"] = {
        pair: {"met": v["within"], "measured": v["measured"], "simulated": v["simulated"], "off": v["off"]}
        for pair, v in sim.get("ratios", {}).items()
    }
    return out


def sim_goal(res: dict[str, Any], pol: str) -> dict[str, Any]:
    """Measured end to end within 15% of the simulator's: met (None where no prediction, or where the run
    applied fewer steps than planned, so the two are not of the same workload), with the figures."""
    sim = res.get("sim") or {}
    a = sim.get("arms", {}).get(pol)
    if a is None:
        return {"met": None, "why": "no simulator prediction (sim phase skipped or failed)"}
    applied, planned = sim.get("steps_applied", {}).get(pol), sim.get("steps_planned")
    whole = applied == planned
    return {
        "met": a["within"] if whole else None,
        **({} if whole else {"why": f"{applied} of {planned} steps applied: not the simulated workload"}),
        "end_to_end_s": a["end_to_end_s"],
        "sim_end_to_end_s": a["sim_end_to_end_s"],
        "sim_ratio": a["sim_ratio"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(DEFAULT_CONFIG))
    p.add_argument("--policies", default="", help="comma list (default: the config's policy)")
    p.add_argument("--out", default=os.environ.get("OUT", "h200-agentic-out"), help="results folder ($OUT)")
    p.add_argument("--work", default="", help="work directory (default: /tmp/h200-agentic-<pid>)")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--warmstart-steps", type=int, default=None, help="default: 100 (GPU), 4 (--tiny)")
    p.add_argument("--contexts", default="", help="migration contexts (default: 16384; --tiny: 256,512)")
    p.add_argument(
        "--skip", default="", help="comma list: warmstart,floors,run,replay,migrate,probe,train,sim"
    )
    p.add_argument(
        "--budget-s", type=float, default=None, help="the call's wall budget (default 575 s; 3000 tiny)"
    )
    p.add_argument(
        "--reuse",
        default="",
        help="comma list of metrics.json (metrics-<policy>.json) of earlier calls' runs: the simulator is "
        "calibrated on them too and their policies count in the goals across policies",
    )
    p.add_argument(
        "--from-run",
        default="",
        help="comma list of the run archives an earlier call wrote to OUT (run-<policy>.tar.xz and its "
        "run-<policy>-batches-<k>.tar.xz): no run in this call; the lone trainer and the replay measure "
        "that run",
    )
    p.add_argument(
        "--model-cache",
        default="",
        help="a folder kept between calls on one machine: the warm-started model is made there once and "
        "reused by a later call of the same shape, dtype, seed and warm start (its model and warmstart "
        "phases then take no time)",
    )
    p.add_argument(
        "--plan",
        action="store_true",
        help="print the phases of this call (--policies, --skip) with their seconds estimated from "
        "--plan-from and whether they fit one call, then exit",
    )
    p.add_argument(
        "--plan-from",
        default=",".join(str(HERE / f) for f in PLAN_FROM),
        help="earlier calls' results, oldest first, and a probe call's (comma list), for the estimates",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="SECTION.KEY=VALUE",
        help="override a key of the config, checked as the file is (e.g. agent.timeout_s=150 "
        "driver.max_ahead=1); the results keep them under `overrides`",
    )
    a = p.parse_args()
    t_begin = h200_run.call_began()
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(a.work or f"/tmp/h200-agentic-{os.getpid()}").resolve()
    work.mkdir(parents=True, exist_ok=True)
    try:
        loaded = load_config(a.config, a.overrides)  # as the file and overrides say (for the plan)
    except ConfigError as exc:
        sys.exit(f"h200_agentic: {exc}")
    cfg = loaded
    say(f"config {a.config}{' with ' + ' '.join(a.overrides) if a.overrides else ''}: timeout "
        f"{cfg.agent.timeout_s:g} s, {cfg.driver.max_ahead} batches ahead")  # fmt: skip
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, keep_batches=True))
    # A part that dies fails the run at once, naming it with its log's last lines: a new attempt from the
    # checkpoint would spend the call's budget and blur the figures.
    cfg = dataclasses.replace(cfg, survive=dataclasses.replace(cfg.survive, restart=False))
    if a.tiny:
        cfg = tiny(cfg, str(work / "run"))
    if a.cpu:
        cfg = dataclasses.replace(cfg, cell=dataclasses.replace(cfg.cell, device="cpu", gpus=[]))
    device = "cuda" if cfg.cell.device == "cuda" else "cpu"
    if device == "cuda":
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus.cell_env(cfg, 0)["CUDA_VISIBLE_DEVICES"]
    skip = set(filter(None, a.skip.split(",")))
    from_run = [Path(x).resolve() for x in a.from_run.split(",") if x]
    if from_run:
        skip.add("run")
    policies = [] if "run" in skip else [x for x in (a.policies or cfg.run.policy).split(",") if x]
    budget = a.budget_s or (3000.0 if a.tiny else 575.0)
    reused = {}
    for path in filter(None, a.reuse.split(",")):
        m = json.loads(Path(path).read_text())
        if m["policy"] not in policies:  # a policy run in this call: its run counts
            reused[m["policy"]] = (path, m)
    ests = plan_estimates(a.plan_from, loaded, {k: m for k, (_, m) in reused.items()}, bool(a.overrides))
    steps = a.warmstart_steps if a.warmstart_steps is not None else (4 if a.tiny else 100)
    steps_plan = plan(policies, skip | ({"warmstart"} if steps <= 0 else set()), ests, bool(from_run))
    known = [x for _, x in steps_plan if x is not None]
    if a.tiny:
        say("plan: the device call of these arguments, in an earlier device call's seconds (not this run's)")
    for name, sec in steps_plan:
        say(f"plan: {name} {'?' if sec is None else f'{sec:.0f}'} s")
    say(f"plan: {sum(known):.0f} s of {CALL_LIMIT_S:.0f} s for one call ({len(known)} of {len(steps_plan)} "
        f"phases estimated from {a.plan_from}); the script's budget {budget:.0f} s")  # fmt: skip
    after_s = reserve_after_run({} if a.tiny else dict(steps_plan))
    after = sum(after_s[n] for n, _ in steps_plan[[n for n, _ in steps_plan].index(f"run-{policies[-1]}") + 1 :]
                if n in after_s) if policies else 0.0  # fmt: skip
    if policies:
        names = [n for n, _ in steps_plan]
        before = sum(x or 0.0 for _, x in steps_plan[: names.index(f"run-{policies[0]}")])
        before += time.monotonic() - t_begin  # the call's seconds before this script, and reading the config
        deadline = min(budget - before - AFTER_RUN_S - STARTUP_S, cfg.run.deadline_s)
        say(f"plan: run-{policies[0]}'s deadline about {deadline:.0f} s ([run] deadline_s "
            f"{cfg.run.deadline_s:.0f} s; a run past its deadline fails and leaves no figures); the parts "
            f"after the runs, {after:.0f} s planned, are skipped where the runs leave them too little")  # fmt: skip
        if (need := ests.get(f"sim-{policies[0]}")) is not None and need > deadline:
            say(f"plan: WARNING: run-{policies[0]}'s end to end as simulated, {need:.0f} s, is past that deadline: "
                "a larger --budget-s (under the call's limit), fewer phases before it, or a shorter run")  # fmt: skip
    if a.plan:
        return 0 if sum(known) <= CALL_LIMIT_S else 1
    res: dict[str, Any] = {"config": a.config, "overrides": a.overrides, "tiny": a.tiny, "device": device, "phase_s": {}, "errors": {},
                           "machine": h200_run.machine(device), "policies": {},
                     "plan_s": dict(steps_plan)}  # fmt: skip
    if reused:
        res["reused"] = {k: {"metrics": path, "end_to_end_s": m.get("end_to_end_s"),
                             "steps_applied": m.get("steps_applied")} for k, (path, m) in reused.items()}  # fmt: skip
    say(f"device {device}; policies {policies}; work {work}")
    signal.signal(signal.SIGTERM, lambda signum, _: stop_keeping_logs(signum, work, out))

    def save() -> None:
        res["goals"] = goals(res)
        (out / RESULTS).write_text(json.dumps(res, indent=1, default=str) + "\n")

    def phase(name: str, fn: Any) -> Any:
        if name in skip:
            return None
        t0 = time.monotonic()
        say(f"{name} ...")
        try:
            return fn()
        except Exception as exc:
            res["errors"][name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            return None
        finally:
            res["phase_s"][name] = round(time.monotonic() - t0, 2)
            say(f"{name} done in {res['phase_s'][name]} s")
            save()

    lr = 3e-3 if a.tiny else 3e-4
    made = {"shape": cfg.run.model_shape, "dtype": cfg.run.model_dtype, "seed": cfg.run.seed,
            "warmstart_steps": steps if "warmstart" not in skip else 0, "lr": lr}  # fmt: skip
    cache = Path(a.model_cache) if a.model_cache else None
    cached = model_cache.find(cache, made) if cache is not None else None
    if cached is not None:
        model_dir, res["warmstart"] = cached
        res["model_cache"] = {"dir": str(model_dir), "reused": True}
        say(f"model: the warm-started model of an earlier call, {model_dir}")
    else:
        if cache is not None:
            model_cache.clear(cache)
        model_dir = phase("model", lambda: h200_run.create_model(cfg, (cache or work) / "model"))
        if model_dir is None:
            return finish(out, res, 1)
        if made["warmstart_steps"] > 0:
            res["warmstart"] = phase("warmstart", lambda: h200_run.warm_start(
                model_dir, device, steps, lr, 64, cfg.run.seed))  # fmt: skip
        if cache is not None and "warmstart" not in res["errors"]:
            model_cache.keep(cache, made, res.get("warmstart"))
            res["model_cache"] = {"dir": str(model_dir), "reused": False}
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, model_dir=str(model_dir)))
    fl = phase("floors", lambda: h200_run.bandwidths(model_dir, device))
    if fl is not None:
        res["bandwidth"] = {"copies": fl["copies"], "xfer": fl["xfer"]}
        res.update(
            {k: fl[k] for k in ("weight_bytes", "floor_to_training_s", "floor_to_rollout_s", "push_floor_s")}
        )
    from gyre.system.run import run

    alone_parts = {"replay", "migrate", "probe"} - skip
    ctx = [int(x) for x in (a.contexts or ("256,512" if a.tiny else "16384")).split(",")]

    def alone(run_dir: Path | None, metrics: dict[str, Any] | None) -> None:
        got = phase(
            "alone",
            lambda: alone_phase(
                cfg, model_dir, run_dir, metrics, work / "alone-logs", ctx, skip, t_begin + budget - 20.0
            ),
        )
        if (work / "alone-logs").is_dir():  # the standalone engines' logs, for what went wrong or slow
            shutil.make_archive(str(out / "logs-alone"), "gztar", work / "alone-logs")
        if got is not None:
            for k in ("standalone_startup_s", "replay", "migrate", "probe_startup_s", "decode_vs_context"):
                if k in got:
                    res[k] = got[k]
            save()

    if alone_parts and "replay" not in alone_parts:  # nothing of the runs needed: measure first
        alone(None, None)
        alone_parts = set()
    first_metrics: dict[str, Any] | None = None
    first_dir: Path | None = None
    if from_run:  # an earlier call's run: its steps trained again and its calls replayed here
        first_dir = runarchive.unpack(from_run, work / "from-run")
        first_metrics = json.loads((first_dir / "metrics.json").read_text())
        res["from_run"] = {"archives": [str(x) for x in from_run], "policy": first_metrics.get("policy"),
                           "end_to_end_s": first_metrics.get("end_to_end_s")}  # fmt: skip
    measured = {k: m for k, (_, m) in reused.items()}
    for pol in policies:
        run_dir = work / f"run-{pol}"
        # the parts after it give way, not the run; its deadline counts from the first rollout
        left = budget - (time.monotonic() - t_begin) - AFTER_RUN_S - STARTUP_S
        c = cfg.with_policy(pol, str(run_dir))
        if left < c.run.deadline_s:
            say(f"run deadline cut to {left:.0f} s to stay within the budget")
            c = dataclasses.replace(c, run=dataclasses.replace(c.run, deadline_s=max(30.0, left)))
        m = phase(f"run-{pol}", lambda c=c: run(c, say=say))
        if m is not None:
            res["policies"][pol] = policy_figures(m, run_dir / "records.msgpack")
            res["policies"][pol]["switch_parts"] = floors.switch_parts(run_dir / "logs")
            measured[pol] = m
            if first_metrics is None:
                first_metrics, first_dir = m, run_dir
                if {"replay", "train"} & skip:  # measured by a later call, if at all
                    keep_run_archives(run_dir, out, res)
        if m is None and (run_dir / "metrics-partial.json").exists():  # cut short: what it did until then
            partial = json.loads((run_dir / "metrics-partial.json").read_text())
            try:
                res.setdefault("partial", {})[pol] = policy_figures(partial, run_dir / "records.msgpack")
            except Exception as exc:  # a run cut short may lack what a figure needs; the file is kept
                res.setdefault("partial", {})[pol] = {"error": f"{type(exc).__name__}: {exc}"}
            if first_metrics is None and partial.get("steps_applied"):  # its applied steps and calls
                first_metrics, first_dir = partial, run_dir  # are trained and replayed as far as it went
                if {"replay", "train"} & skip:
                    keep_run_archives(run_dir, out, res)
        keep_run_outputs(run_dir, out)
    if measured:  # the simulator on the same workload, calibrated on every run measured
        res["sim"] = phase("sim", lambda: sim_phase(cfg, measured))
        for pol, f in ((res.get("sim") or {}).get("arms") or {}).items():
            where = res["policies"] if pol in res["policies"] else res.get("reused", {})
            where[pol].update(sim_end_to_end_s=f["sim_end_to_end_s"], sim_ratio=f["sim_ratio"])
        save()
    elif "sim" not in skip:
        res["sim"] = {"skipped": "no run measured in this call or reused"}

    def room(part: str, need: float) -> bool:
        """Whether `need` seconds of the budget are left for `part`; else it is skipped, saying so."""
        left = t_begin + budget - time.monotonic()
        if left >= need:
            return True
        res.setdefault("skipped", {})[part] = f"{left:.0f} s of the call's budget left, {need:.0f} s planned"
        say(f"{part} skipped: {res['skipped'][part]}")
        return False

    if first_metrics is not None and first_dir is not None and room("train", after_s["train"]):
        res["train_again"] = phase(
            "train", lambda: train_phase(cfg, model_dir, first_dir, first_metrics, device)
        )
        save()
    if (
        "replay" in alone_parts
        and first_metrics is not None
        and not room("replay", after_s["alone-startup"] + after_s["replay"])
    ):
        skip.add("replay")
    if alone_parts and room("alone", after_s["alone-startup"]):
        alone(first_dir, first_metrics)
    lacking = res.get("train_again") is None or res.get("replay") is None
    if first_dir is not None and not from_run and "run_archives" not in res and lacking:
        keep_run_archives(first_dir, out, res)  # what the call's time did not allow, for a later one
    return finish(out, res, 0 if len(res["policies"]) == len(policies) and not res["errors"] else 1)


def keep_run_archives(run_dir: Path, out: Path, res: dict[str, Any]) -> None:
    """The run's metrics, record log and kept steps as archives in `out` (`runarchive`), so that a later
    call can train and replay them (`--from-run`) where this one has no time left to; their names and
    sizes under `run_archives`, with any a call would not return."""
    try:
        paths = runarchive.pack(run_dir, out, run_dir.name.removeprefix("run-"))
    except FileNotFoundError as exc:
        res["run_archives"] = {"error": str(exc)}
        return
    res["run_archives"] = {
        "files": {p.name: p.stat().st_size for p in paths},
        "too_large": runarchive.too_large(paths),
    }
    say(f"run archives for --from-run: {res['run_archives']}")


def keep_run_outputs(run_dir: Path, out: Path) -> None:
    """A run's timeline and metrics (whole or partial) into `out` as `<stem>-<policy><suffix>`, and every
    process's log as `logs-<policy>.tar.gz`, for the note on where the time went. The archive holds the
    timelines too: a machine that hands back only so many files from `out` leaves the last ones out, and
    the run archives for `--from-run` come before the timelines."""
    pol = run_dir.name.removeprefix("run-")
    kept = [
        name
        for name in ("timeline.png", "metrics.json", "timeline-partial.png", "metrics-partial.json")
        if (run_dir / name).exists()
    ]
    for name in kept:
        shutil.copy(run_dir / name, out / f"{Path(name).stem}-{pol}{Path(name).suffix}")
    if (run_dir / "logs").is_dir():
        with tarfile.open(out / f"logs-{pol}.tar.gz", "w:gz") as tar:
            tar.add(run_dir / "logs", arcname=".")
            for name in kept:
                if name.endswith(".png"):
                    tar.add(run_dir / name, arcname=name)


def stop_keeping_logs(signum: int, work: Path, out: Path) -> None:
    """On SIGTERM (the call's wall limit: `h200_run.sh` passes it on): what each run has so far into `out`
    as the end of a run would put it, then SystemExit, which stops the run's processes on its way out. A
    call cut short still says where its time went."""
    for run_dir in sorted(work.glob("run-*")):
        keep_run_outputs(run_dir, out)
    say(f"signal {signum}: stopped; the runs' logs are in {out}")
    raise SystemExit(128 + signum)


def finish(out: Path, res: dict[str, Any], rc: int) -> int:
    res["goals"] = goals(res)
    (out / RESULTS).write_text(json.dumps(res, indent=1, default=str) + "\n")
    rows = [f"{pol}: e2e {p.get('end_to_end_s')} s (simulated {p.get('sim_end_to_end_s')} s), first / later step "
            f"{p.get('first_step_train_s')} / {p.get('later_step_train_s_median')} s, shares {p.get('engine_call_share')}, hits "
            f"{p.get('prefix_cache_hit_share')} (ideal {p.get('prefix_cache_hit_share_ideal')}), ctx max {p.get('context_tokens_max')}" for pol, p in res["policies"].items()]  # fmt: skip
    say("\n  ".join(["results", *rows, f"replay {res.get('replay')}", f"train {res.get('train_again')}",
                     f"migrate {res.get('migrate')}", f"goals {res['goals']}", f"errors {res['errors'] or 'none'}"]))  # fmt: skip
    return rc


if __name__ == "__main__":
    sys.exit(main())
