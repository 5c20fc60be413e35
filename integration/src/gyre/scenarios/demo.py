"""`gyre demo`: the embedded default, learning on a laptop-class CPU. A supervised warm start (or its
cache), then RL with the elastic policy on two cells through `gyre run`, the held-out evaluation at a
fixed interval, one line per step, and the results.

Writes into `--out`: `demo.json` (eval_before, eval_after, train_score_first/last, steps,
model_tool_call_share, warmstart_s, wall_s, and the per-step figures), `reward.png` (train and eval
score per step), the run's `timeline.png` and `metrics.json`, TensorBoard event files under `tb/` (the
run's per-step scalars, and the demo's own: train and eval score per weight version), and the trained
policy as a Hugging Face model directory under `policy/` (every `gyre run` writes both). `--control`
runs the same seeds with learning rate 0, so a rise that is not learning shows; `--quick` is the small
run CI uses. A demo on a directory that holds a finished one shows that one's results and leaves it as
it is; one that stopped after its first step is not resumed (give another `--out`); one that never
reached its first step starts again.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre.config.runconfig import (
    AgentSection,
    BatchSection,
    Config,
    DriverSection,
    EvalSection,
    RunSection,
    SchedSection,
    TrainSection,
)
from gyre.measure.samples import engines_serve
from gyre.measure.scalars import ScalarLog
from gyre.rollout.evalset import eval_points
from gyre.rollout.warmstart import WarmStartConfig, warm_start
from gyre.system import run as gyre_run
from gyre.system.evaluator import Evaluator
from gyre.system.rundir import RunFinished, RunUnfinished, read_state, steps_done
from gyre.system.runparts import RunContext

ENTROPY_COLLAPSE = 0.25
"""Warn when the policy's mean entropy on its tokens falls below this share of the first step's."""


@dataclass(frozen=True)
class DemoConfig:
    out: str = "gyre-demo"
    """Output directory (created)."""
    seed: int = 0
    """Seeds the RL run: its training tasks and the sampling (the held-out tasks are the same for all)."""
    warmstart_seed: int = 0
    """Seeds the warm start (model init, transcripts); seeds of the RL run share it and its cache."""
    control: bool = False
    """Learning rate 0: the same run with no learning (the control)."""
    quick: bool = False
    """A small run for CI: a few warm-start steps of the tiny shape, 2 RL steps (it learns nothing)."""
    steps: int = 0
    """RL steps (0: the preset's)."""
    lr: float = 0.0
    """RL learning rate (0: the preset's; --control sets 0 whatever this says)."""


def warmstart_config(d: DemoConfig) -> WarmStartConfig:
    if d.quick:
        return WarmStartConfig(shape="tiny", seed=d.warmstart_seed, steps=12, batch=4, warmup=2)
    return WarmStartConfig(seed=d.warmstart_seed)


def run_config(d: DemoConfig, model_dir: Path) -> Config:
    """The `gyre run` configuration of the demo (an ordinary Config: `gyre run` accepts the same)."""
    steps = d.steps or (2 if d.quick else 20)
    lr = 0.0 if d.control else (d.lr or 3e-4)
    return Config(
        run=RunSection(
            policy="elastic", cells=2, steps=steps, seed=d.seed, out_dir=d.out, model_dir=str(model_dir),
            deadline_s=1800.0, startup_timeout_s=600.0,
        ),
        batch=BatchSection(queries=2 if d.quick else 8, group_size=2 if d.quick else 4),
        agent=AgentSection(
            turns=3, max_tokens=48, temperature=1.0, median_s=0.05, sigma=0.0, exec_sigma=0.0,
            model_fraction=1.0, timeout_s=120.0, request_timeout_s=120.0,
        ),
        driver=DriverSection(max_ahead=1),
        train=TrainSection(lr=lr, token_budget=2048, loss="ppo", j_max=5),
        eval=EvalSection(tasks=8 if d.quick else 48, every=2 if d.quick else 5, seed=0, max_tokens=48),
        sched=SchedSection(ready_fraction=0.5, hold_s=0.3),
    )  # fmt: skip


class StepReporter:
    """Prints one line per applied step (with the evaluation at that version, when there is one) and
    writes the demo's scalars (`measure.scalars.ScalarLog`, TensorBoard only) by weight version."""

    name = "demo-report"

    def __init__(self, cfg: Config, evaluator: Evaluator | None, say: Any) -> None:
        self.cfg = cfg
        self.evaluator = evaluator
        self.say = say
        self.points = set(eval_points(cfg.run.steps, cfg.eval.every)) if evaluator else set()
        self.rows: list[dict[str, Any]] = []
        self.printed_evals = 0
        self.entropy0: float | None = None
        self.finished = False
        self._tb: ScalarLog | None = None
        """The writer, opened when the run starts (a run refused at start writes no file)."""

    @property
    def tb(self) -> ScalarLog:
        assert self._tb is not None, "the reporter writes scalars once the run started it"
        return self._tb

    def start(self, ctx: RunContext) -> None:
        if self._tb is None:
            self._tb = ScalarLog(ctx.out, suffix=".demo")
        self.say(
            f"{'step':>4} {'ver':>3} {'train':>6} {'eval':>6} {'loss':>8} {'kl':>7} {'clip':>5} "
            f"{'entropy':>7} {'stale':>5} {'tok/s':>6}"
        )

    def _evals(self) -> dict[int, dict[str, Any]]:
        return {r["version"]: r for r in (self.evaluator.results if self.evaluator else [])}

    def tick(self, ctx: RunContext) -> None:
        evals = self._evals()
        if 0 in evals and self.printed_evals == 0:
            self.printed_evals = 1
            self._eval_line(evals[0], "before RL")
        path = ctx.out / "steps.jsonl"
        rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        for r in rows[len(self.rows) :]:
            k = int(r["step"]) - 1
            sd = ctx.traj.steps.get(k)
            if sd is None or not sd.summary or (r["version"] in self.points and r["version"] not in evals):
                return  # wait for its summary, and for the evaluation at its version
            self._step_line(r, sd.summary, evals)
        last = self.cfg.run.steps
        self.finished = (
            ctx.traj.applied >= last and len(self.rows) == last and engines_serve(ctx.sampler.samples, last)
        )

    def _step_line(
        self, r: dict[str, Any], summary: dict[str, Any], evals: dict[int, dict[str, Any]]
    ) -> None:
        m = r.get("metrics", {})
        prev_end = self.rows[-1]["t_end"] if self.rows else r["t_start"]
        tok_s = summary.get("tokens", 0) / max(1e-6, r["t_end"] - prev_end)
        v = int(r["version"])
        ev = evals.get(v)
        row = {
            "step": int(r["step"]),
            "version": v,
            "train_score": summary.get("mean_score"),
            "eval_score": ev["score"] if ev else None,
            "loss": r["loss"],
            "approx_kl": m.get("approx_kl"),
            "clip_frac": m.get("clip_frac"),
            "entropy": m.get("entropy"),
            "staleness": r["staleness"]["mean"],
            "tokens_per_s": round(tok_s, 1),
            "t_end": r["t_end"],
        }
        self.rows.append(row)

        def f(x: Any, fmt: str) -> str:
            return "-" if x is None else format(x, fmt)

        warn = ""
        ent = row["entropy"]
        if ent is not None:
            self.entropy0 = self.entropy0 or ent
            if ent < ENTROPY_COLLAPSE * self.entropy0:
                warn = f"  WARNING: entropy collapsed to {ent:.3f} ({ent / self.entropy0:.0%} of step 1's)"
        self.say(
            f"{row['step']:>4} {v:>3} {f(row['train_score'], '6.3f')} {f(row['eval_score'], '6.3f'):>6} "
            f"{row['loss']:8.4f} {f(row['approx_kl'], '7.4f')} {f(row['clip_frac'], '5.3f')} "
            f"{f(ent, '7.3f')} {row['staleness']:5.2f} {row['tokens_per_s']:6.0f}{warn}"
        )
        names = ("train_score", "eval_score", "loss", "approx_kl", "clip_frac", "entropy", "staleness")
        self.tb.write(v, {f"demo/{n}": row[n] for n in (*names, "tokens_per_s") if row[n] is not None})
        if ev:
            self._eval_line(ev, f"at version {v}")

    def _eval_line(self, ev: dict[str, Any], when: str) -> None:
        fams = ", ".join(f"{k} {x:.2f}" for k, x in ev["by_family"].items())
        self.say(f"     eval {when}: {ev['score']} ({fams}; {ev['eval_failed']} evaluation failures)")
        scalars = {f"eval_by_family/{k}": x for k, x in ev["by_family"].items()}
        if ev["version"] == 0:
            scalars["demo/eval_score"] = ev["score"] or 0.0
        self.tb.write(ev["version"], scalars)

    def done(self) -> bool:
        return self.finished

    def stop(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def finished_demo(out: Path) -> dict[str, Any] | None:
    """The results of the demo that finished in `out` (None: no run there, or one that never reached its
    first step, which a demo starts again). RunFinished: a finished run that is not a demo;
    RunUnfinished: a demo that stopped after its first step (a demo is not resumed)."""
    st = read_state(out)
    if st is None:
        return None
    if st["state"] == "finished":
        if not (out / "demo.json").exists():
            raise RunFinished(
                f"{out} holds a finished run that is not a demo (kept); give the demo another --out"
            )
        return dict(json.loads((out / "demo.json").read_text()))
    done = steps_done(out)
    if done == 0:
        return None
    raise RunUnfinished(
        f"{out} holds a demo that stopped after {done} of its steps ({st['state']}); a demo is not resumed: "
        "give another --out"
    )


def _results_line(result: dict[str, Any], out: Path) -> str:
    return (
        f"eval {result['eval_before']} -> {result['eval_after']}, train score "
        f"{result['train_score_first']} -> {result['train_score_last']}, model tool calls "
        f"{result['model_tool_call_share']:.0%}, {result['wall_s']:.0f} s; {out / 'demo.json'}"
    )


def demo(d: DemoConfig, say: Any = print) -> dict[str, Any]:
    t0 = time.time()
    out = Path(d.out).resolve()
    done = finished_demo(out)
    if done is not None:
        say(
            f"gyre demo: {out} holds a finished demo, kept as it is (--out DIR for a new one): "
            f"{_results_line(done, out)}, {out / 'reward.png'}"
        )
        return done
    out.mkdir(parents=True, exist_ok=True)
    ws_cfg = warmstart_config(d)
    model_dir, ws = warm_start(ws_cfg, say)
    warm_s = time.time() - t0
    cfg = run_config(dataclasses.replace(d, out=str(out)), model_dir)
    say(
        f"gyre demo: RL for {cfg.run.steps} steps of {cfg.batch.queries} tasks x {cfg.batch.group_size} "
        f"executions, lr {cfg.train.lr:g}{' (control)' if d.control else ''}; held-out evaluation of "
        f"{cfg.eval.tasks} tasks at versions {eval_points(cfg.run.steps, cfg.eval.every)}"
    )
    evaluator = Evaluator(cfg)
    reporter = StepReporter(cfg, evaluator, say)
    metrics = gyre_run.run(cfg, say=say, parts=[evaluator, reporter])
    result = summarize(d, cfg, ws, warm_s, metrics, reporter.rows, evaluator.results, time.time() - t0)
    (out / "demo.json").write_text(json.dumps(result, indent=1) + "\n")
    plot_rewards(result, out / "reward.png")
    say(f"gyre demo: {_results_line(result, out)}")
    return result


def summarize(
    d: DemoConfig,
    cfg: Config,
    ws: dict[str, Any],
    warm_s: float,
    metrics: dict[str, Any],
    rows: list[dict[str, Any]],
    evals: list[dict[str, Any]],
    wall_s: float,
) -> dict[str, Any]:
    tools = {"model": 0, "script": 0, "missed": 0}
    for o in metrics["outcomes"]:
        for k, n in (o.get("tools") or {}).items():
            tools[k] += n
    needed = sum(tools.values())
    by_v = {e["version"]: e for e in evals}
    train = [r["train_score"] for r in rows if r["train_score"] is not None]
    return {
        "seed": d.seed,
        "control": d.control,
        "quick": d.quick,
        "lr": cfg.train.lr,
        "eval_before": by_v[0]["score"] if 0 in by_v else None,
        "eval_after": by_v[cfg.run.steps]["score"] if cfg.run.steps in by_v else None,
        "train_score_first": train[0] if train else None,
        "train_score_last": train[-1] if train else None,
        "steps": len(rows),
        "model_tool_call_share": tools["model"] / needed if needed else 0.0,
        "tool_calls": tools,
        "warmstart_s": round(warm_s, 2),
        "warmstart": ws,
        "wall_s": round(wall_s, 2),
        "rl_s": metrics["end_to_end_s"],
        "evals": [{k: v for k, v in e.items() if k != "answers"} for e in evals],
        "per_step": rows,
        "config": cfg.to_dict(),
    }


def plot_rewards(result: dict[str, Any], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib comes with gyre-sched[plot]
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    rows = result["per_step"]
    xs = [r["version"] for r in rows if r["train_score"] is not None]
    ax.plot(
        xs, [r["train_score"] for r in rows if r["train_score"] is not None], "o-", label="train (sampled)"
    )
    ev = [(e["version"], e["score"]) for e in result["evals"] if e["score"] is not None]
    if ev:
        ax.plot(*zip(*ev, strict=True), "s-", label="held-out eval (greedy)")
    ax.set_xlabel("weight version (optimizer steps)")
    ax.set_ylabel("mean score")
    ax.set_ylim(0, 1.02)
    title = "control (lr 0)" if result["control"] else f"lr {result['lr']:g}"
    ax.set_title(f"gyre demo, seed {result['seed']}, {title}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
