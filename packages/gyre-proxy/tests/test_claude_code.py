"""The real Claude Code CLI (npm @anthropic-ai/claude-code, pinned 2.1.328) against the proxy, offline, in a
temporary directory, with the scripted engine (a test fixture) deciding each reply from the rendered input
it receives.

1. The main loop calls the Agent tool, the sub-agent runs Bash, both finish. Asserted on the records: each
   output is what the engine returned, each input is what the engine received, every later input of a
   loop carries its earlier outputs unchanged (no drift), and the roles are main and subagent; then
   `/compact` on the continued session is a main_summary call that still carries the main loop's ids,
   and the session continued after the compaction (whose first request holds an empty system-role
   message) is answered and recorded exactly as the engine saw it, with no drift.
2. The main loop forks twice (`subagent_type: "fork"`); both forks and the main loop answer the same
   text, and the session is continued once more.

Install: npm install --no-audit --no-fund --prefix packages/gyre-proxy/.claude-code @anthropic-ai/claude-code@2.1.328
(or point GYRE_CLAUDE_BIN at a `claude` binary). Without it this test is skipped and says so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from gyre_traj.io import read_records
from gyre_traj.records import Call, Role
from gyre_traj.tree import Forest
from tokenizers import Tokenizer

pytestmark = pytest.mark.slow

PKG = Path(__file__).resolve().parents[1]
CANDIDATES = [
    PKG / ".claude-code/node_modules/.bin/claude",
    Path("/tmp/gyre-claude/node_modules/.bin/claude"),
]


def claude_bin() -> str | None:
    env = os.environ.get("GYRE_CLAUDE_BIN")
    if env:
        return env
    for c in CANDIDATES:
        if c.exists():
            return str(c)
    return shutil.which("claude")


AGENT_CALL = (
    '<tool_call>\n{"name": "Agent", "arguments": {"description": "write sub file", "prompt": "write hi to sub.txt", '
    '"subagent_type": "general-purpose", "run_in_background": false}}\n</tool_call>'
)
BASH_CALL = '<tool_call>\n{"name": "Bash", "arguments": {"command": "echo hi > sub.txt", "description": "write file"}}\n</tool_call>'


def test_claude_code_with_a_subagent(
    engine: Any, make_proxy: Any, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    exe = claude_bin()
    if exe is None:
        pytest.skip(
            "Claude Code CLI not installed: npm install --prefix packages/gyre-proxy/.claude-code "
            "@anthropic-ai/claude-code@2.1.328 (or set GYRE_CLAUDE_BIN)"
        )

    def reply(ids: list[int]) -> str:
        text = tokenizer.decode(ids, skip_special_tokens=False)
        if "<tools>" not in text:
            return "Side answer."
        done = "<tool_response>" in text
        if "You are an agent for Claude Code" in text:  # the sub-agent's system prompt
            return "sub done" if done else BASH_CALL
        return "All done." if done else AGENT_CALL

    engine.default = reply
    ps = make_proxy([engine.url], max_context_tokens=400_000)
    work = tmp_path / "work"
    work.mkdir()
    env = {
        **os.environ,
        "ANTHROPIC_BASE_URL": ps.url,
        "ANTHROPIC_API_KEY": "anything",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "IS_SANDBOX": "1",
        "HOME": str(tmp_path),
    }
    cmd = [
        exe,
        "-p",
        "use an agent to write hi to sub.txt",
        "--output-format",
        "json",
        "--allowedTools",
        "Bash,Read,Write,Edit,Agent",
    ]
    p = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-2000:] + p.stdout[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["result"] == "All done." and not out["is_error"]
    assert (work / "sub.txt").read_text().strip() == "hi"

    recs = [r for r in read_records(ps.log_path) if isinstance(r, Call)]
    assert len(recs) >= 4
    seen = {s.rid: s.input_ids for s in engine.seen}
    full: dict[str, np.ndarray] = {}
    seq: dict[str, np.ndarray] = {}
    for r in recs:
        rid = f"{r.execution_id}/{r.call_id}"
        assert r.output_ids.tolist() == engine.by_rid[rid]  # exactly what the engine returned
        if r.input_ids is not None:
            inp = r.input_ids
        else:
            assert r.input_delta is not None
            inp = np.concatenate([seq[r.input_delta.parent][: r.input_delta.keep], r.input_delta.append])
        assert inp.tolist() == seen[rid]  # exactly what the engine received
        full[r.call_id] = inp
        seq[r.call_id] = np.concatenate([inp, r.output_ids])
    session = recs[0].execution_id
    assert session != "default" and all(r.execution_id == session for r in recs)
    mains = [r for r in recs if r.role is Role.MAIN]
    subs = [r for r in recs if r.role is Role.SUBAGENT]
    assert len(mains) == 2 and all(r.agent_id == "main" for r in mains)
    # the sub-agent's id is the one Claude Code gave it (`x-claude-code-agent-id`), the same on each call
    assert len(subs) >= 2 and len({r.agent_id for r in subs}) == 1
    assert subs[0].agent_id != "main" and not subs[0].agent_id.startswith("sub-")  # not the hash fallback
    assert all("cc_is_subagent=true" in r.metadata["stripped.claude-code-billing"] for r in subs)
    # no drift: the main loop's second input carries its first input and output unchanged
    first = seq[mains[0].call_id].tolist()
    assert full[mains[1].call_id].tolist()[: len(first)] == first
    assert mains[1].input_delta is not None and mains[1].input_delta.parent == mains[0].call_id
    stats = httpx.get(f"{ps.url}/gyre/stats").json()
    assert stats["recorded_tokens"] > 0  # assistant turns came from records, not re-tokenized

    # compaction of the same session (`/compact` on the continued conversation): a main_summary call whose
    # input still carries the main loop's first input and output unchanged
    engine.default = lambda ids: "<summary>A sub-agent wrote hi to sub.txt.</summary>"
    p = subprocess.run(
        [exe, "-p", "/compact", "--continue", "--output-format", "json"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert p.returncode == 0, p.stderr[-2000:] + p.stdout[-2000:]
    recs2 = [r for r in read_records(ps.log_path) if isinstance(r, Call)][len(recs) :]
    assert [r.role for r in recs2] == [Role.MAIN_SUMMARY]
    summ = recs2[0]
    d = summ.input_delta
    assert d is not None and d.parent in seq
    summ_input = np.concatenate([seq[d.parent][: d.keep], d.append])
    seen = {s.rid: s.input_ids for s in engine.seen}
    assert summ_input.tolist() == seen[f"{summ.execution_id}/{summ.call_id}"]
    assert summ.execution_id == session  # the continued conversation is the same execution
    assert summ_input.tolist()[: len(first)] == first

    # the trajectory side reads the log as it is: one execution tree, every record ingested, no drift
    forest = Forest().add_msgpack(ps.log_path.read_bytes())
    tree = forest.trees[session]
    assert len(tree.calls) == len(recs) + 1 and tree.stats.drifts == []
    roles = {r.role for r in [*recs, summ]}
    assert roles == {Role.MAIN, Role.SUBAGENT, Role.MAIN_SUMMARY}

    # a session continued after `/compact`: Claude Code 2.1.328 then sends `{"role": "system",
    # "content": []}` as messages[1]; the call is answered and recorded exactly as the engine saw it
    engine.default = lambda ids: "Still done."
    p = subprocess.run(
        [exe, "-p", "and now?", "--continue", "--output-format", "json"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert p.returncode == 0, p.stderr[-2000:] + p.stdout[-2000:]
    assert json.loads(p.stdout.strip().splitlines()[-1])["result"] == "Still done."
    recs3 = [r for r in read_records(ps.log_path) if isinstance(r, Call)][len(recs) + 1 :]
    assert [r.role for r in recs3] == [Role.MAIN] and recs3[0].execution_id == session
    seen = {s.rid: s.input_ids for s in engine.seen}
    seq[summ.call_id] = np.concatenate([summ_input, summ.output_ids])
    after = recs3[0]
    d = after.input_delta
    after_input = after.input_ids if d is None else np.concatenate([seq[d.parent][: d.keep], d.append])
    assert after_input.tolist() == seen[f"{session}/{after.call_id}"]
    assert after.output_ids.tolist() == engine.by_rid[f"{session}/{after.call_id}"]
    text = tokenizer.decode(after_input.tolist(), skip_special_tokens=False)
    assert "<|im_start|>system\n<|im_end|>\n" in text  # the empty system message, as the template renders it
    tree = Forest().add_msgpack(ps.log_path.read_bytes()).trees[session]
    assert len(tree.calls) == len(recs) + 2 and tree.stats.drifts == []
