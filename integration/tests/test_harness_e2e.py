"""`gyre run` end to end with each harness: the example configs on real processes with the tiny random
model. The built-in agent's trees branch (main_summary and subagent leaves, J_max drops); real Claude
Code processes and the OpenAI-SDK command agent run, are scored, and are trained on. Each run checks
that every step was applied and that each step's loss tokens equal the output tokens the proxy recorded
for the executions it trained (the check of `test_run_e2e.py`, here under streaming)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gyre.config.runconfig import Config, load_config
from gyre.rollout.harnesses import find_claude
from gyre.system.run import run
from gyre_traj.io import read_records
from gyre_traj.records import Call
from gyre_traj.select import SelectionConfig, select
from gyre_traj.tree import Forest

from .runcheck import assert_no_fault

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _processes_mentioning(text: str) -> list[str]:
    """Processes (other than this one) whose command line mentions `text` (as test_run_e2e.py's)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd and int(pid) != os.getpid():
            found.append(f"{pid}: {cmd}")
    return found


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gyre_engine.server.model_factory import create_model

    return create_model(tmp_path_factory.mktemp("model") / "tiny")


def _example(name: str, out: Path, model_dir: Path) -> Config:
    c = load_config(EXAMPLES / name)
    r = dataclasses.replace(  # generous: the shared 2-core machine can be slow to start processes
        c.run, out_dir=str(out), model_dir=str(model_dir), startup_timeout_s=600.0, deadline_s=1200.0
    )
    return dataclasses.replace(c, run=r)


def _selected_output_tokens(records: list[Call], executions: list[str], j_max: int) -> int:
    """The output tokens the proxy recorded on the trajectories J_max selection keeps, each token
    position once, rebuilt from the log alone: a call is on a selected leaf's path when its input and
    output are a prefix of the leaf call's; a position is its prefix of tokens."""
    forest = Forest()
    full: dict[tuple[str, str], np.ndarray] = {}
    n_in: dict[tuple[str, str], int] = {}
    for r in records:
        forest.add(r)
        if r.input_ids is not None:
            inp = r.input_ids
        else:
            assert r.input_delta is not None
            d = r.input_delta
            inp = np.concatenate([full[(r.execution_id, d.parent)][: d.keep], d.append])
        full[(r.execution_id, r.call_id)] = np.concatenate([inp, r.output_ids])
        n_in[(r.execution_id, r.call_id)] = len(inp)
    total = 0
    for eid in executions:
        positions: set[bytes] = set()
        for leaf in select(forest.trees[eid], SelectionConfig(j_max=j_max)).leaves:
            path = full[(eid, leaf.call_id)]
            for (e, c), seq in full.items():
                if e == eid and len(seq) <= len(path) and np.array_equal(seq, path[: len(seq)]):
                    positions |= {path[: i + 1].tobytes() for i in range(n_in[(e, c)], len(seq))}
        total += len(positions)
    return total


def _check_trained_once(m: dict[str, Any], out: Path, steps: int, j_max: int) -> list[Call]:
    """Steps applied; every execution scored (or an evaluation failure) and trained at most once, in its
    own step; each step's loss tokens = the recorded output tokens of the trajectories J_max selected in
    the executions it trained (all of them when nothing was dropped)."""
    assert m["steps_applied"] == steps and m["steps_skipped"] == 0 and m["final_version"] == steps
    assert m["streaming"] is True
    trained = [e for s in m["steps"] for e in s["trained_executions"]]
    assert trained and len(trained) == len(set(trained))
    for s in m["steps"]:
        assert all(e.startswith(f"s{s['step']}-") for e in s["trained_executions"])
    records = [r for r in read_records(out / "records.msgpack") if isinstance(r, Call)]
    logged: dict[str, int] = {}
    for rec in records:
        logged[rec.execution_id] = logged.get(rec.execution_id, 0) + len(rec.output_ids)
    for s in m["steps"]:
        assert s["output_tokens_recorded"] == sum(logged[e] for e in s["trained_executions"])
        assert s["loss_tokens"] == _selected_output_tokens(records, s["trained_executions"], j_max)
        if s["jmax_dropped"] == 0:
            assert s["loss_tokens"] == s["output_tokens_recorded"]
        assert set(s["leaves_by_role"]) == set(s["trained_executions"])
    assert {r.execution_id for r in records} <= {o["execution_id"] for o in m["outcomes"]}
    assert_no_fault(m, out)
    assert _processes_mentioning(str(out)) == []
    return records


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(1800)  # startup alone took 8 min on the shared machine under load 15-18
def test_builtin_agent_trees_branch(tmp_path: Path, model_dir: Path) -> None:
    cfg = _example("tiny.toml", tmp_path / "run", model_dir)
    assert cfg.agent.compact_tokens and cfg.agent.subagents and cfg.agent.call_retries
    m = run(cfg, say=lambda _: None)
    records = _check_trained_once(m, tmp_path / "run", cfg.run.steps, cfg.train.j_max)
    roles = {role for s in m["steps"] for by in s["leaves_by_role"].values() for role in by}
    assert {"main", "main_summary", "subagent"} <= roles
    assert any(s["jmax_dropped"] > 0 for s in m["steps"])
    assert {str(r.role) for r in records} >= {"main", "main_summary", "subagent"}
    subs = {r.agent_id for r in records if str(r.role) == "subagent"}
    assert subs and all(a.startswith("sub-") for a in subs)  # the agent id the harness sent


def _cli_run(name: str, tmp_path: Path, model_dir: Path) -> tuple[dict[str, Any], list[Call], Config]:
    cfg = _example(name, tmp_path / "run", model_dir)
    m = run(cfg, say=lambda _: None)
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["steps_applied"] == m["steps_applied"]
    records = _check_trained_once(m, tmp_path / "run", cfg.run.steps, cfg.train.j_max)
    assert m["executions"] == cfg.run.steps * cfg.batch.queries * cfg.batch.group_size
    for o in m["outcomes"]:  # every execution made calls and was scored on its working directory
        assert o["calls"] >= 1 and not o["error"], o
        assert o["score"] is not None and 0.0 <= o["score"] <= 1.0
    # nothing of an execution is left behind but its log
    for d in (tmp_path / "run" / "executions").iterdir():
        assert sorted(p.name for p in d.iterdir()) == ["output.log"]
    return m, records, cfg


@pytest.mark.slow
@pytest.mark.timeout(1800)  # startup alone took 8 min on the shared machine under load 15-18
def test_claude_code_example_end_to_end(tmp_path: Path, model_dir: Path) -> None:
    if find_claude() is None:
        pytest.skip(
            "Claude Code CLI not installed: npm install --prefix packages/gyre-proxy/.claude-code "
            "@anthropic-ai/claude-code@2.1.328 (or set GYRE_CLAUDE_BIN)"
        )
    m, records, _ = _cli_run("claude-code.toml", tmp_path, model_dir)
    assert {str(r.role) for r in records} >= {"main"}
    assert all(r.agent_id == "main" or r.agent_id for r in records)
    # Claude Code's own calls: its system prompt, at the proxy's per-execution route
    assert {r.execution_id for r in records} == {o["execution_id"] for o in m["outcomes"]}


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(1800)  # startup alone took 8 min on the shared machine under load 15-18
def test_command_openai_example_end_to_end(tmp_path: Path, model_dir: Path) -> None:
    m, records, _ = _cli_run("command-openai.toml", tmp_path, model_dir)
    assert {str(r.role) for r in records} == {"main"}
    assert {r.execution_id for r in records} == {o["execution_id"] for o in m["outcomes"]}


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_profile_harness_end_to_end(tmp_path: Path, model_dir: Path) -> None:
    """The profile workload scaled to the CPU: every output has exactly its planned length (sampled by the
    model with `ignore_eos`), contexts grow by the tool outputs, the trees branch by compaction
    (main_summary) and sub-agents (subagent), and every step trains what was recorded, once."""
    from gyre.rollout.agents import profile

    cfg = _example("profile-cpu.toml", tmp_path / "run", model_dir)
    m = run(cfg, say=lambda _: None)
    records = _check_trained_once(m, tmp_path / "run", cfg.run.steps, cfg.train.j_max)
    assert {str(r.role) for r in records} >= {"main", "main_summary", "subagent"}
    p = cfg.profile
    for r in records:
        k, q, j = (int(x[1:]) for x in r.execution_id.split("-"))
        planned = profile.plan(p, cfg.run.seed, k, q, j, 0.0).outputs
        assert r.output_ids.size in planned, (r.execution_id, r.call_id, r.output_ids.size, planned)
    longest = max(
        (r.input_delta.keep + r.input_delta.append.size if r.input_delta else r.input_ids.size)  # type: ignore[union-attr]
        for r in records
    )
    assert longest > p.prompt_tokens + p.tool_tokens_min
    assert m["executions"] == cfg.run.steps * cfg.batch.queries * cfg.batch.group_size
    # the example's shape fits its timeout (tool time + each plan's calls at the tiny model's speed): the
    # executions end on their own, the timeout at most cuts a tail of them
    assert m["timeouts"] <= m["executions"] // 4, [(o["execution_id"], o["calls"]) for o in m["outcomes"]]
