"""Synthetic agent executions shaped like the report's: a main agent whose context grows call by call,
compactions (main_summary calls, after which the context restarts from the summary), sub-agents (with
their own contexts and, optionally, their own compaction), retried calls and re-tokenization drift.

Used for the shipped example, the tests and the benchmark. Token ids come from per-role bands so a
failure reads as names: system 1000s, user 2000s, tool output 3000s, policy output 4000s-5000s,
summary instructions 6000s, sub-agent system prompt 7000s.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from gyre_traj.records import ID_DTYPE, Call, Delta, EvalStatus, Role, Score

SYSTEM, USER, TOOL, POLICY, SUMMARY_REQ, SUB_SYSTEM = 1000, 2000, 3000, 4000, 6000, 7000


@dataclass(frozen=True)
class SynthConfig:
    main_calls: int = 600
    """Calls of the main agent (compaction summaries, sub-agent calls and retries come on top)."""
    max_context: int = 700_000
    """Context the main agent reaches just before each compaction."""
    compactions: int = 3
    subagents: int = 8
    subagent_calls: int = 6
    subagent_compactions: int = 1
    """How many of the sub-agents compact once (subagent_summary calls)."""
    retries: int = 6
    """Main calls that are retried (the first attempt is recorded too, then discarded by the harness)."""
    drifts: int = 0
    """Main calls whose successor carries the assistant output re-tokenized (one token changed)."""
    system_tokens: int = 2000
    output_tokens: tuple[int, int] = (50, 400)
    summary_tokens: int = 2000
    delta: bool = True
    """Delta-encode inputs against the agent's previous call (else every input in full)."""
    seed: int = 0


class _Gen:
    def __init__(self, cfg: SynthConfig, execution_id: str) -> None:
        self.cfg = cfg
        self.eid = execution_id
        self.rng = np.random.default_rng(cfg.seed)
        self.t = 0.0
        self.n_calls = 0
        self.version = 0
        self.out: list[Call] = []

    def toks(self, band: int, n: int) -> np.ndarray:
        return (band + self.rng.integers(0, 1000, size=max(0, n))).astype(ID_DTYPE)

    def policy_out(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        ids = (POLICY + self.rng.integers(0, 2000, size=n)).astype(ID_DTYPE)
        lps = -self.rng.exponential(0.7, size=n).astype(np.float32)
        return ids, lps

    def call(
        self,
        agent: str,
        role: Role,
        ctx: np.ndarray,
        parent: tuple[str, int] | None,
        appended: np.ndarray,
        n_out: int,
        finish: str = "stop",
    ) -> tuple[str, np.ndarray]:
        """Record a call whose input is ctx (= parent's sequence[:keep] + appended). Returns (id, out)."""
        cid = f"c{self.n_calls:05d}"
        self.n_calls += 1
        out, lps = self.policy_out(n_out)
        t0 = self.t
        self.t += 0.5 + float(self.rng.exponential(3.0))
        common = dict(
            execution_id=self.eid,
            call_id=cid,
            agent_id=agent,
            role=role,
            output_ids=out,
            output_logprobs=lps,
            weight_version=self.version,
            finish_reason=finish,
            t_start=t0,
            t_end=self.t,
        )
        if self.cfg.delta and parent is not None:
            rec = Call(input_delta=Delta(parent[0], parent[1], appended), **common)  # type: ignore[arg-type]
        else:
            rec = Call(input_ids=ctx, **common)  # type: ignore[arg-type]
        self.out.append(rec)
        return cid, out


def _spread(k: int, n: int, rng: np.random.Generator, lo: int = 1) -> set[int]:
    if k <= 0 or n <= lo:
        return set()
    return {int(x) for x in rng.choice(np.arange(lo, n), size=min(k, n - lo), replace=False)}


def synth_execution(cfg: SynthConfig, execution_id: str = "exec-0") -> list[Call]:
    """One execution's calls, in the order a proxy would record them."""
    g = _Gen(cfg, execution_id)
    rng = g.rng
    epochs = cfg.compactions + 1
    per_epoch = max(1, cfg.main_calls // epochs)
    mean_out = sum(cfg.output_tokens) // 2
    growth = max(1, (cfg.max_context - cfg.system_tokens - cfg.summary_tokens) // per_epoch)
    tool_mean = max(1, growth - mean_out)
    compact_at = {per_epoch * (e + 1) for e in range(cfg.compactions)}
    sub_at = _spread(cfg.subagents, cfg.main_calls, rng)
    retry_at = _spread(cfg.retries, cfg.main_calls, rng)
    drift_at = _spread(cfg.drifts, cfg.main_calls - 1, rng)
    sub_compact = set(sorted(sub_at)[: cfg.subagent_compactions])

    system = g.toks(SYSTEM, cfg.system_tokens)
    ctx = np.concatenate([system, g.toks(USER, 200)])
    parent: tuple[str, int] | None = None
    appended = ctx
    sub_count = 0
    for k in range(cfg.main_calls):
        if k in compact_at:
            req = g.toks(SUMMARY_REQ, 64)
            cid, summary = g.call(
                "main",
                Role.MAIN_SUMMARY,
                np.concatenate([ctx, req]),
                parent,
                np.concatenate([appended, req]),
                cfg.summary_tokens,
            )
            restart = np.concatenate([g.toks(USER, 16), summary, g.toks(USER, 16)])
            ctx = np.concatenate([system, restart])
            parent, appended = (cid, cfg.system_tokens), restart
        n_out = int(rng.integers(cfg.output_tokens[0], cfg.output_tokens[1] + 1))
        if k in retry_at:
            g.call("main", Role.MAIN, ctx, parent, appended, max(1, n_out // 3), finish="abort")
        cid, out = g.call("main", Role.MAIN, ctx, parent, appended, n_out)
        seen_out = out
        if k in drift_at and out.shape[0] > 2:
            seen_out = out.copy()
            seen_out[out.shape[0] // 2] = POLICY + 1999 - (int(out[out.shape[0] // 2]) - POLICY) % 1000
        if k in sub_at:
            result = _run_subagent(g, cfg, f"sub{sub_count}", out, k in sub_compact)
            sub_count += 1
            tool = np.concatenate([g.toks(TOOL, 8), result, g.toks(TOOL, 8)])
        else:
            tool = g.toks(TOOL, int(rng.integers(tool_mean // 2, tool_mean * 3 // 2 + 1)))
        keep = ctx.shape[0] + (out.shape[0] if seen_out is out else out.shape[0] // 2)
        appended = np.concatenate([seen_out[keep - ctx.shape[0] :], tool])
        ctx = np.concatenate([ctx, seen_out, tool])
        parent = (cid, keep)
    return g.out


def _run_subagent(g: _Gen, cfg: SynthConfig, agent: str, task_src: np.ndarray, compact: bool) -> np.ndarray:
    """A sub-agent's calls; returns its final answer (which the main agent gets as a tool result)."""
    rng = g.rng
    sys_sub = g.toks(SUB_SYSTEM, max(16, cfg.system_tokens // 4))
    ctx = np.concatenate([sys_sub, g.toks(USER, 8), task_src[: min(64, task_src.shape[0])]])
    parent: tuple[str, int] | None = None
    appended = ctx
    out = np.zeros(0, ID_DTYPE)
    for j in range(cfg.subagent_calls):
        if compact and j == cfg.subagent_calls // 2:
            req = g.toks(SUMMARY_REQ, 32)
            cid, summary = g.call(
                agent,
                Role.SUBAGENT_SUMMARY,
                np.concatenate([ctx, req]),
                parent,
                np.concatenate([appended, req]),
                max(8, cfg.summary_tokens // 4),
            )
            restart = np.concatenate([g.toks(USER, 8), summary])
            ctx = np.concatenate([sys_sub, restart])
            parent, appended = (cid, sys_sub.shape[0]), restart
        n_out = int(rng.integers(cfg.output_tokens[0], cfg.output_tokens[1] + 1))
        cid, out = g.call(agent, Role.SUBAGENT, ctx, parent, appended, n_out)
        tool = g.toks(TOOL, int(rng.integers(cfg.output_tokens[0], cfg.output_tokens[1] + 1)))
        parent = (cid, ctx.shape[0] + out.shape[0])
        appended = tool
        ctx = np.concatenate([ctx, out, tool])
    return out


def synth_group(
    cfg: SynthConfig, group_id: str, n: int, *, eval_failures: int = 0, timeouts: int = 0
) -> Iterator[Call | Score]:
    """`n` executions of one query (a group) and their scores; the first `eval_failures` executions'
    evaluations fail and the next `timeouts` are partial scores of timed-out executions."""
    rng = np.random.default_rng(cfg.seed + 10_000)
    for i in range(n):
        eid = f"{group_id}-e{i}"
        yield from synth_execution(SynthConfig(**{**cfg.__dict__, "seed": cfg.seed + i}), eid)
        if i < eval_failures:
            yield Score(
                execution_id=eid,
                group_id=group_id,
                status=EvalStatus.EVAL_FAILED,
                detail="synthetic: evaluator crashed",
            )
        else:
            timed_out = i < eval_failures + timeouts
            value = round(float(rng.uniform(0.0, 1.0)), 3)
            yield Score(execution_id=eid, group_id=group_id, value=value, timed_out=timed_out)
