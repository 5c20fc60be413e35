"""Harness configuration refused before anything starts, coding tasks scored by hidden unit tests, and a
CLI harness's whole process group ended by the driver's timeout (real processes, no model)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from gyre.config.runconfig import Config, ConfigError, config_from_dict
from gyre.rollout.agents.agent import Execution
from gyre.rollout.agents.branching import COMPACT_PROMPT, SUB_TURNS, Branching, run_branching
from gyre.rollout.harnesses import CliHarness, check_harness
from gyre.rollout.tasks.coding import SOLUTION, make_code_task, run_tests
from gyre.rollout.tasks.qa import make_task
from gyre_traj.records import EvalStatus

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _agent(**kw: object) -> Config:
    cfg = config_from_dict({"agent": kw})
    check_harness(cfg.agent)  # what `gyre run` checks once the file is loaded
    return cfg


@pytest.mark.parametrize(
    ("agent", "names"),
    [
        (
            {"harness": "claude-code", "claude_bin": "/nonexistent/claude"},
            ["[agent] claude_bin", "npm install"],
        ),
        ({"harness": "command", "command": "echo hi"}, ["[agent] command must contain {prompt}"]),
        ({"harness": "command"}, ["[agent] command is required"]),
        ({"harness": "command", "command": "no-such-agent-xyz {prompt}"}, ["'no-such-agent-xyz'", "PATH"]),
        ({"harness": "command", "command": "echo {prompt} {cwd}"}, ["unknown placeholder", "cwd"]),
        ({"harness": "builtin", "tasks": "code"}, ['[agent] tasks = "code"', "claude-code or command"]),
        ({"harness": "command", "command": "echo {prompt}", "subagents": True}, ["builtin harness"]),
        ({"harness": "codex"}, ["[agent] harness must be one of builtin, claude-code, command"]),
    ],
)
def test_bad_harness_config_is_refused_naming_the_key(agent: dict[str, object], names: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        _agent(**agent)
    for n in names:
        assert n in str(e.value)


def test_claude_code_needs_temperature_one(tmp_path: Path) -> None:
    fake = tmp_path / "claude"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert _agent(harness="claude-code", claude_bin=str(fake)).agent.harness == "claude-code"
    with pytest.raises(ConfigError, match=r"\[agent\] temperature must be 1.0 with claude-code"):
        _agent(harness="claude-code", claude_bin=str(fake), temperature=0.7)


def test_the_command_example_loads() -> None:
    from gyre.config.runconfig import load_config

    c = load_config(EXAMPLES / "command-openai.toml")
    check_harness(c.agent)
    assert c.agent.harness == "command" and c.agent.tasks == "code"


def _write(tmp_path: Path, body: str) -> Path:
    (tmp_path / SOLUTION).write_text(body)
    return tmp_path


def test_code_task_partial_scores_and_evaluation_failures(tmp_path: Path) -> None:
    task = make_code_task(random.Random(0), "g", family="clamp")
    assert "clamp(x, lo, hi)" in task.prompt and len(task.tests) == 3
    right = "def clamp(x, lo, hi):\n    return max(lo, min(hi, x))\n"
    assert asyncio.run(run_tests(task, _write(tmp_path, right))) == {n: True for n, _ in task.tests}
    half = "def clamp(x, lo, hi):\n    return min(hi, x)\n"  # forgets the lower bound: 2 of 3
    assert sum(asyncio.run(run_tests(task, _write(tmp_path, half))).values()) == 2
    broken = "def clamp(x, lo, hi:\n"  # a syntax error is the agent's: every test fails, a real 0
    assert not any(asyncio.run(run_tests(task, _write(tmp_path, broken))).values())
    slow = "def clamp(x, lo, hi):\n    while True:\n        pass\n"  # each test's alarm fails it
    assert not any(asyncio.run(run_tests(task, _write(tmp_path, slow))).values())


def test_a_test_run_that_cannot_report_is_an_evaluation_failure(tmp_path: Path) -> None:
    from gyre.rollout.tasks.coding import evaluate_code

    task = make_code_task(random.Random(0), "g", family="add")
    ok = asyncio.run(
        evaluate_code(task, _write(tmp_path, "def add(a, b):\n    return a + b\n"), "e", "g", False)
    )
    assert ok.status is EvalStatus.OK and ok.value == 1.0
    gone = "import os\nos._exit(0)\n"  # the runner dies on import, before its report
    s = asyncio.run(evaluate_code(task, _write(tmp_path, gone), "e", "g", False))
    assert s.status is EvalStatus.EVAL_FAILED and s.value is None and "without its report" in s.detail


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_the_drivers_timeout_ends_the_whole_process_tree(tmp_path: Path) -> None:
    # The agent starts a grandchild (as a tool would) and hangs; the driver's timeout cancels the run:
    # both must be gone, the task's stub was in its fresh working directory, and the env names its route.
    code = (
        "import os, subprocess, sys, time; p = subprocess.Popen(['sleep', '300']); "
        "open('pids', 'w').write(str(os.getpid()) + ' ' + str(p.pid)); "
        "open('env', 'w').write(os.environ['ANTHROPIC_BASE_URL'] + ' ' + os.environ['OPENAI_BASE_URL']); "
        "time.sleep(300)"
    )
    cfg = config_from_dict(
        {
            "run": {"out_dir": str(tmp_path)},
            "agent": {"harness": "command", "command": f'{{python}} -c "{code}" {{prompt}}', "tasks": "code"},
        }
    )
    h = CliHarness(cfg, keep=True)
    ex = h.execution("s0-q0-e0", "s0-q0", make_code_task(random.Random(1), "s0-q0"), 1.0, (0, 0, 0))

    async def go() -> None:
        async with httpx.AsyncClient() as http:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(h.run(http, "http://127.0.0.1:9", ex), timeout=3.0)

    asyncio.run(go())
    pids = [int(x) for x in (ex.workdir / "pids").read_text().split()]
    assert not any(_alive(p) for p in pids)
    assert (ex.workdir / SOLUTION).read_text().startswith("def ")
    assert (
        ex.workdir / "env"
    ).read_text() == "http://127.0.0.1:9/e/s0-q0-e0 http://127.0.0.1:9/e/s0-q0-e0/v1"
    assert ex.tool_s == 0.0  # a CLI harness's tool time is its own: nothing slept
    s = asyncio.run(h.score(ex, True, ""))
    assert s.status is EvalStatus.OK and s.timed_out and s.value == 0.0  # the stub passes no test


class _FakeProxy(ThreadingHTTPServer):
    """A loopback server answering `/e/{execution}/v1/messages` as gyre-proxy does without a tool call:
    a text reply cut at max_tokens, usage split into uncached and cache-read input; it keeps each request
    (headers and body) and can be told to answer slowly."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.seen: list[tuple[dict[str, str], dict[str, Any]]] = []
        self.delay_s = delay_s
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                outer.seen.append(({k.lower(): v for k, v in self.headers.items()}, body))
                time.sleep(outer.delay_s)
                out = {
                    "id": f"msg_{len(outer.seen)}", "type": "message", "role": "assistant", "model": body["model"],
                    "content": [{"type": "text", "text": "zq xv"}], "stop_reason": "max_tokens",
                    "stop_sequence": None,
                    "usage": {"input_tokens": 7, "output_tokens": 12, "cache_creation_input_tokens": 0,
                              "cache_read_input_tokens": 90},
                }  # fmt: skip
                data = json.dumps(out).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.shutdown()
        self.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def _execution() -> Execution:
    return Execution("s0-q0-e0", "g", make_task(random.Random(0), "g"), 0.0)


def _branching_run(proxy: _FakeProxy, ex: Execution, timeout_s: float = 30.0) -> Execution:
    policy = Branching(compact_tokens=64, subagents=True, call_retries=1)

    async def go() -> None:
        async with httpx.AsyncClient(timeout=30.0) as http:
            coro = run_branching(
                http, proxy.url, ex, policy, turns=3, max_tokens=12, temperature=1.0, retry_for_s=5.0,
                scripted_fallback=True,
            )  # fmt: skip
            await asyncio.wait_for(coro, timeout_s)

    asyncio.run(go())
    return ex


def test_branching_agent_compacts_delegates_and_retries() -> None:
    proxy = _FakeProxy()
    try:
        ex = _branching_run(proxy, _execution())
    finally:
        proxy.close()
    seen = proxy.seen
    assert ex.calls == len(seen)
    agents = [h.get("x-gyre-agent", "") for h, _ in seen]
    # every cut reply is sent again once, unchanged (same agent, same body); the summary call is not
    i = 0
    while i < len(seen):
        if COMPACT_PROMPT in json.dumps(seen[i][1]["messages"][-1]):
            i += 1
            continue
        assert (agents[i], seen[i][1]) == (agents[i + 1], seen[i + 1][1])
        i += 2
    # the scripted step went to a sub-agent: its own conversation, asked to make the task's call
    subs = [b for h, b in seen if h.get("x-gyre-agent") == "sub-1"]
    assert subs and subs[0]["messages"][0]["content"].startswith("Call ")
    assert len(subs) == 2 * SUB_TURNS  # two calls, each retried once
    # compaction: the context (7 + 90 cached + 12 > 64) asked for Claude Code's summary, then a restart
    summaries = [b for _, b in seen if COMPACT_PROMPT in json.dumps(b["messages"][-1])]
    assert summaries and all(len(b["messages"]) >= 3 for b in summaries)
    after = seen[seen.index(next(x for x in seen if COMPACT_PROMPT in json.dumps(x[1]["messages"][-1]))) + 1][
        1
    ]
    assert len(after["messages"]) == 1 and "Summary of the work so far" in after["messages"][0]["content"]


def test_a_call_in_flight_at_the_timeout_is_counted() -> None:
    # The proxy records a call the harness was cancelled during; the agent waits for it and counts it,
    # so the trajectory service expects that record too.
    proxy = _FakeProxy(delay_s=1.0)
    ex = _execution()
    try:
        with pytest.raises(TimeoutError):
            _branching_run(proxy, ex, timeout_s=0.5)
    finally:
        proxy.close()
    assert len(proxy.seen) == 1 and ex.calls == 1
