"""Harness configuration refused before anything starts, coding tasks scored by hidden unit tests, and a
CLI harness's whole process group ended by the driver's timeout (real processes, no model)."""

from __future__ import annotations

import asyncio
import os
import random
import time
from pathlib import Path

import httpx
import pytest
from gyre.codetasks import SOLUTION, make_code_task, run_tests
from gyre.config import Config, ConfigError, config_from_dict
from gyre.harnesses import CliHarness
from gyre_traj.records import EvalStatus

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _agent(**kw: object) -> Config:
    return config_from_dict({"agent": kw})


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
    from gyre.config import load_config

    c = load_config(EXAMPLES / "command-openai.toml")
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
    t0 = time.monotonic()
    assert not any(asyncio.run(run_tests(task, _write(tmp_path, slow))).values())
    assert time.monotonic() - t0 < 60


def test_a_test_run_that_cannot_report_is_an_evaluation_failure(tmp_path: Path) -> None:
    from gyre.codetasks import evaluate_code

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
    ex = h.execution("s0-q0-e0", "s0-q0", make_code_task(random.Random(1), "s0-q0"), 1.0)

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
