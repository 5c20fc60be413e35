"""Harnesses: who runs one execution of `gyre run` (`[agent] harness`), and how it is scored.

- `builtin`: this package's tool-using agent over the Anthropic Messages API (`agent.py`; with
  compaction, sub-agents or call retries configured, `branching.py`), on the built-in question tasks;
  on your own tasks (`[tasks] train`), one chat completion of the row's prompt (`agents/chat.py`).
- `claude-code`: one real Claude Code CLI process per execution (`claude -p`), in a fresh working
  directory holding the task's files, with its own HOME and TMPDIR, `ANTHROPIC_BASE_URL` pointed at the
  execution's route on gyre-proxy (`/e/{execution}`), the offline settings (no telemetry, no
  non-essential traffic, no auto-update, no error reporting), `CLAUDE_CODE_MAX_OUTPUT_TOKENS` =
  `[agent] max_tokens`, `--max-turns` = `[agent] turns` and the task's tool allow-list (`--tools` and
  `--allowedTools`). Its final answer is the JSON result's `result`.
- `profile`: executions shaped like the report's long agent runs (`agents/profile.py`, `[profile]`):
  planned call counts, output lengths, growing tool outputs, compaction, sub-agents and the duration
  profile's heavy tail, over the OpenAI front; for measuring the system at that shape.
- `command`: any command-line agent from `[agent] command` (`{prompt}`, `{workdir}`, `{python}` replaced in
  each word; no shell), given `ANTHROPIC_BASE_URL` and `OPENAI_BASE_URL` of its execution; its standard
  output, stripped, is the final answer. `gyre.rollout.agents.openai_agent` is an example on the OpenAI front.

A CLI harness's process is the leader of its own process group; the driver's timeout (a cancellation)
ends the whole group (SIGTERM, then SIGKILL after `KILL_GRACE_S`), and so does a normal exit (whatever
its tools left running). The model calls an execution made are the records the trajectory service
received for it, counted once the count has stayed put for `SETTLE_S` after the process ended. The
working directory is scored (coding tasks: `tasks/coding.py`) or the final answer (questions: `tasks/qa.py`;
your own tasks: your reward function, `tasks/reward.py`, given the rows' prompt as one text, `{prompt}`),
then the execution's directory is removed: nothing of one execution is visible to another.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shlex
import shutil
import signal
import string
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
from gyre_traj.records import EvalStatus, Score

from gyre.config.runconfig import AgentSection, Config, ConfigError
from gyre.procs.group import die_with_parent
from gyre.rollout.agents import agent, branching, chat, profile
from gyre.rollout.tasks import coding, qa
from gyre.rollout.tasks.dataset import Cursor, DatasetTask, TaskSet, load_tasks
from gyre.rollout.tasks.reward import Reward, RewardError
from gyre.rollout.tasks.rows import DataError

HARNESSES = ("builtin", "claude-code", "command", "profile")
TASK_KINDS = ("qa", "code")
COMMAND_FIELDS = ("prompt", "workdir", "python")
PINNED_CLAUDE = (
    Path(__file__).resolve().parents[4] / "packages/gyre-proxy/.claude-code/node_modules/.bin/claude"
)
"""Where CI installs the pinned Claude Code (a source checkout; `.ci/run`)."""
SETTLE_S = 0.5
KILL_GRACE_S = 2.0
OFFLINE_ENV = {
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_BUG_COMMAND": "1",
    "IS_SANDBOX": "1",
}
"""Claude Code's settings for a machine with nothing to reach but the proxy."""


def find_claude(configured: str = "") -> str | None:
    """The Claude Code executable: `configured`, else $GYRE_CLAUDE_BIN, else the pinned install, else
    `claude` on PATH; None if the chosen one is not an executable file."""
    for c in (configured, os.environ.get("GYRE_CLAUDE_BIN", "")):
        if c:  # an explicit choice is used or refused, never skipped
            return c if Path(c).is_file() and os.access(c, os.X_OK) else None
    if PINNED_CLAUDE.is_file() and os.access(PINNED_CLAUDE, os.X_OK):
        return str(PINNED_CLAUDE)
    return shutil.which("claude")


def check_harness(a: AgentSection) -> None:
    """Refuse a harness configuration that cannot run, naming the key and the fix (`ConfigError`)."""

    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(msg)

    need(a.harness in HARNESSES, f"[agent] harness must be one of {', '.join(HARNESSES)}, got {a.harness!r}")
    need(a.tasks in TASK_KINDS, f"[agent] tasks must be one of {', '.join(TASK_KINDS)}, got {a.tasks!r}")
    if a.harness == "builtin":
        need(
            a.tasks == "qa", '[agent] tasks = "code" needs a harness with file tools: claude-code or command'
        )
    else:
        need(
            a.compact_tokens == 0 and not a.subagents and a.call_retries == 0,
            "[agent] compact_tokens, subagents and call_retries are the builtin harness's; a CLI harness "
            "compacts, delegates and retries on its own, and the profile harness takes them from "
            "[profile]: remove them",
        )
    if a.harness == "profile":
        need(a.tasks == "qa", "[agent] tasks: the profile harness writes its own tasks; leave tasks unset")
    if a.harness == "claude-code":
        chosen = a.claude_bin or os.environ.get("GYRE_CLAUDE_BIN", "")
        where = f"at {chosen!r}" if chosen else "found ($GYRE_CLAUDE_BIN, the pinned install, PATH)"
        need(
            find_claude(a.claude_bin) is not None,
            f"[agent] claude_bin: no Claude Code CLI {where}; install it: npm install --prefix "
            "packages/gyre-proxy/.claude-code @anthropic-ai/claude-code@2.1.328, or set [agent] claude_bin "
            "or $GYRE_CLAUDE_BIN",
        )
        need(
            a.temperature == 1.0,
            "[agent] temperature must be 1.0 with claude-code (it sends none; the proxy samples at 1.0)",
        )
    if a.harness == "command":
        _check_command(a.command, need)


def _check_command(template: str, need: Callable[[bool, str], None]) -> None:
    need(bool(template.strip()), '[agent] command is required with harness = "command"; e.g. '
         '"{python} -m gyre.rollout.agents.openai_agent {prompt}"')  # fmt: skip
    try:
        words = shlex.split(template)
        fields = {f for w in words for _, f, _, _ in string.Formatter().parse(w) if f is not None}
    except ValueError as exc:
        need(False, f"[agent] command cannot be split into words: {exc}")
        return
    bad = fields - set(COMMAND_FIELDS)
    need(not bad, f"[agent] command: unknown placeholder(s) {sorted(bad)}; known: {{prompt}}, {{workdir}}, "
         "{python} (double other braces: {{ }})")  # fmt: skip
    need("prompt" in fields, "[agent] command must contain {prompt} (where the task's prompt goes), e.g. "
         f"{template.strip()} {{prompt}}")  # fmt: skip
    exe = words[0]
    if exe != "{python}":
        found = shutil.which(exe) if "/" not in exe else (exe if os.access(exe, os.X_OK) else None)
        need(found is not None, f"[agent] command: {exe!r} is not an executable on PATH; give its full path "
             "or install it ({python} is this interpreter)")  # fmt: skip


def check_tasks(cfg: Config) -> tuple[TaskSet, Reward] | None:
    """Your own tasks (`[tasks] train`), read and checked, and the reward function, loaded; None for the
    built-in tasks. A bad file, row, column or reward is a `ConfigError` naming the key and the file."""
    t = cfg.tasks
    if not t.train:
        return None
    if cfg.agent.harness == "profile":
        raise ConfigError("[tasks] train: the profile harness writes its own tasks; use builtin, command "
                          "or claude-code")  # fmt: skip
    try:
        tasks = load_tasks(t)
    except DataError as exc:
        key = "eval" if t.eval and str(exc).startswith(t.eval) else "train"  # messages open with the path
        raise ConfigError(f"[tasks] {key}: {exc}") from exc
    try:
        reward = Reward.load(t.reward, t.reward_timeout_s)
    except RewardError as exc:
        raise ConfigError(f"[tasks] reward: {exc}") from exc
    return tasks, reward


@dataclass
class OwnTasks:
    """`[tasks]`: the training rows, drawn in turn (`Cursor`, from the run's seed), and the reward."""

    cursor: Cursor
    reward: Reward

    @classmethod
    def of(cls, cfg: Config) -> OwnTasks | None:
        own = check_tasks(cfg)
        if own is None:
            return None
        tasks, reward = own
        return cls(Cursor(tasks.train, cfg.run.seed), reward)

    async def score(self, task: DatasetTask, ex: Run, timed_out: bool, error: str) -> Score:
        s, _ = await self.reward.score(task, ex.execution_id, ex.group_id, ex.final_text, timed_out, error)
        return s


class Run(Protocol):
    """What the driver reads of an execution, whatever harness ran it."""

    execution_id: str
    group_id: str
    tool_s: float
    calls: int
    final_text: str | None

    def tool_calls(self) -> dict[str, int]: ...


class Harness(Protocol):
    def task(self, rng: random.Random, group_id: str) -> Any: ...

    def execution(
        self, execution_id: str, group_id: str, task: Any, tool_s: float, where: tuple[int, int, int]
    ) -> Run:
        """The execution `execution_id` of `task`; `where` is its (batch, query, index in the group)."""
        ...

    async def run(self, http: httpx.AsyncClient, proxy_url: str, ex: Any) -> None: ...

    async def settle(self, ex: Any, recorded: Callable[[str], int]) -> None: ...

    async def score(self, ex: Any, timed_out: bool, error: str) -> Score: ...


def make_harness(cfg: Config) -> Harness:
    a = cfg.agent
    if a.harness == "builtin" and cfg.tasks.train:
        return ChatHarness(cfg)
    if a.harness == "builtin":
        return BuiltinHarness(cfg)
    if a.harness == "profile":
        return ProfileHarness(cfg)
    return CliHarness(cfg)


@dataclass
class ProfileHarness:
    """Executions shaped like the report's (`agents/profile.py`), each with the plan of its place in the
    run; a group's executions share one task prompt of `[profile] prompt_tokens`."""

    cfg: Config
    filler: profile.Filler = field(init=False)

    def __post_init__(self) -> None:
        self.filler = profile.Filler(model_dir_of(self.cfg))

    def task(self, rng: random.Random, group_id: str) -> str:
        body = self.filler.text(
            random.Random(f"{self.cfg.run.seed}/{group_id}"), self.cfg.profile.prompt_tokens
        )
        return f"Task {group_id}. Read the notes, use the tools, end with an answer full of digits.\n{body}"

    def execution(
        self, execution_id: str, group_id: str, task: str, tool_s: float, where: tuple[int, int, int]
    ) -> profile.ProfileExecution:
        p = profile.plan(self.cfg.profile, self.cfg.run.seed, *where, tool_s)
        return profile.ProfileExecution(execution_id, group_id, task, tool_s, p)

    async def run(self, http: httpx.AsyncClient, proxy_url: str, ex: profile.ProfileExecution) -> None:
        a = self.cfg.agent
        await profile.run_profile(
            http,
            proxy_url,
            ex,
            self.cfg.profile,
            self.filler,
            temperature=a.temperature,
            retry_for_s=a.timeout_s,
        )

    async def settle(self, ex: profile.ProfileExecution, recorded: Callable[[str], int]) -> None:
        return None  # the agent counts its own completed calls

    async def score(self, ex: profile.ProfileExecution, timed_out: bool, error: str) -> Score:
        if error:
            return Score(
                execution_id=ex.execution_id, group_id=ex.group_id, status=EvalStatus.EVAL_FAILED,
                timed_out=timed_out, detail=error,
            )  # fmt: skip
        return Score(
            execution_id=ex.execution_id, group_id=ex.group_id, value=profile.score_text(ex.final_text),
            timed_out=timed_out,
        )  # fmt: skip


def model_dir_of(cfg: Config) -> Path:
    """The policy's model directory: `[run] model_dir`, else the one `gyre run` creates in out_dir."""
    return Path(cfg.run.model_dir) if cfg.run.model_dir else Path(cfg.run.out_dir) / "model"


@dataclass
class BuiltinHarness:
    cfg: Config

    def task(self, rng: random.Random, group_id: str) -> qa.Task:
        return qa.make_task(rng, group_id)

    def execution(
        self, execution_id: str, group_id: str, task: qa.Task, tool_s: float, where: tuple[int, int, int]
    ) -> agent.Execution:
        return agent.Execution(execution_id, group_id, task, tool_s)

    async def run(self, http: httpx.AsyncClient, proxy_url: str, ex: agent.Execution) -> None:
        a = self.cfg.agent
        kw: dict[str, Any] = dict(
            turns=a.turns, max_tokens=a.max_tokens, temperature=a.temperature,
            retry_for_s=a.timeout_s, scripted_fallback=a.scripted_fallback,
        )  # fmt: skip
        if a.compact_tokens or a.subagents or a.call_retries:
            policy = branching.Branching(a.compact_tokens, a.subagents, a.call_retries)
            await branching.run_branching(http, proxy_url, ex, policy, **kw)
        else:
            await agent.run_execution(http, proxy_url, ex, **kw)

    async def settle(self, ex: agent.Execution, recorded: Callable[[str], int]) -> None:
        return None  # the agent counts its own completed calls

    async def score(self, ex: agent.Execution, timed_out: bool, error: str) -> Score:
        return qa.evaluate(
            ex.task, ex.execution_id, ex.group_id, ex.final_text, timed_out, error, ex.model_calls()
        )


@dataclass
class ChatHarness:
    """The built-in harness on your own tasks: one chat completion of each row's prompt (`agents/chat.py`),
    scored by your reward function."""

    cfg: Config
    own: OwnTasks = field(init=False)

    def __post_init__(self) -> None:
        own = OwnTasks.of(self.cfg)
        assert own is not None, "ChatHarness runs [tasks] train"
        self.own = own

    def task(self, rng: random.Random, group_id: str) -> DatasetTask:
        return self.own.cursor.next()

    def execution(
        self, execution_id: str, group_id: str, task: DatasetTask, tool_s: float, where: tuple[int, int, int]
    ) -> chat.ChatExecution:
        return chat.ChatExecution(execution_id, group_id, task, tool_s)

    async def run(self, http: httpx.AsyncClient, proxy_url: str, ex: chat.ChatExecution) -> None:
        a = self.cfg.agent
        await chat.run_chat(
            http, proxy_url, ex, max_tokens=a.max_tokens, temperature=a.temperature, retry_for_s=a.timeout_s
        )

    async def settle(self, ex: chat.ChatExecution, recorded: Callable[[str], int]) -> None:
        return None  # the harness counts its own completed call

    async def score(self, ex: chat.ChatExecution, timed_out: bool, error: str) -> Score:
        return await self.own.score(ex.task, ex, timed_out, error)


@dataclass
class CliExecution:
    execution_id: str
    group_id: str
    task: qa.Task | coding.CodeTask | DatasetTask
    root: Path
    """The execution's own directory: `work/` (its working directory), `home/`, `tmp/`, `output.log`."""
    tool_s: float = 0.0
    """A CLI harness's tool time is its own (nothing is slept)."""
    calls: int = 0
    final_text: str | None = None
    returncode: int | None = None
    argv: list[str] = field(default_factory=list)

    @property
    def workdir(self) -> Path:
        return self.root / "work"

    def tool_calls(self) -> dict[str, int]:
        return {}


def _kill_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


@dataclass
class CliHarness:
    cfg: Config
    keep: bool = False
    """Keep each execution's directory after scoring (debugging); off: removed once scored."""
    own: OwnTasks | None = field(init=False)

    def __post_init__(self) -> None:
        self.own = OwnTasks.of(self.cfg)

    @property
    def base(self) -> Path:
        return Path(self.cfg.run.out_dir).resolve() / "executions"

    def task(self, rng: random.Random, group_id: str) -> qa.Task | coding.CodeTask | DatasetTask:
        if self.own is not None:
            return self.own.cursor.next()
        if self.cfg.agent.tasks == "code":
            return coding.make_code_task(rng, group_id)
        return qa.make_task(rng, group_id)

    def execution(
        self,
        execution_id: str,
        group_id: str,
        task: qa.Task | coding.CodeTask | DatasetTask,
        tool_s: float,
        where: tuple[int, int, int],
    ) -> CliExecution:
        return CliExecution(execution_id, group_id, task, self.base / execution_id)

    def argv(self, ex: CliExecution) -> list[str]:
        a = self.cfg.agent
        if a.harness == "claude-code":
            exe = find_claude(a.claude_bin)
            assert exe is not None  # the config check refused a missing CLI
            tools = ",".join(ex.task.tools) if isinstance(ex.task, coding.CodeTask) else ""
            return [
                exe, "-p", ex.task.prompt, "--output-format", "json", "--max-turns", str(a.turns),
                "--tools", tools, "--allowedTools", tools,
            ]  # fmt: skip
        values = {"prompt": ex.task.prompt, "workdir": str(ex.workdir), "python": sys.executable}
        return [w.format(**values) for w in shlex.split(a.command)]

    def env(self, ex: CliExecution, proxy_url: str) -> dict[str, str]:
        a = self.cfg.agent
        route = f"{proxy_url}/e/{ex.execution_id}"
        own = {
            "HOME": str(ex.root / "home"),
            "TMPDIR": str(ex.root / "tmp"),
            "ANTHROPIC_BASE_URL": route,
            "ANTHROPIC_API_KEY": "gyre",
            "OPENAI_BASE_URL": f"{route}/v1",
            "OPENAI_API_KEY": "gyre",
            "GYRE_EXECUTION": ex.execution_id,
            "GYRE_WORKDIR": str(ex.workdir),
            "GYRE_MAX_TOKENS": str(a.max_tokens),
            "GYRE_TURNS": str(a.turns),
            "GYRE_TEMPERATURE": str(a.temperature),
        }
        if a.harness == "claude-code":  # a clean environment: nothing of this machine's user leaks in
            keep = {k: os.environ[k] for k in ("PATH", "LANG", "LC_ALL", "TZ") if k in os.environ}
            return {**keep, **OFFLINE_ENV, "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(a.max_tokens), **own}
        inherited = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "OPENAI_"))}
        return {**inherited, **own}

    async def run(self, http: httpx.AsyncClient, proxy_url: str, ex: CliExecution) -> None:
        if ex.root.exists():
            shutil.rmtree(ex.root)
        for d in ("work", "home", "tmp"):
            (ex.root / d).mkdir(parents=True)
        if isinstance(ex.task, coding.CodeTask):
            coding.populate(ex.task, ex.workdir)
        ex.argv = self.argv(ex)
        log = open(ex.root / "output.log", "wb")  # noqa: SIM115 - closed in the finally below
        try:
            proc = await asyncio.create_subprocess_exec(
                *ex.argv, cwd=ex.workdir, env=self.env(ex, proxy_url), stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=log, start_new_session=True, preexec_fn=die_with_parent,
            )  # fmt: skip
            try:
                out, _ = await proc.communicate()
            finally:  # finished, failed or cancelled by the driver's timeout: end the whole group
                await self._end_group(proc)
            ex.returncode = proc.returncode
            log.write(b"\n--- stdout ---\n" + out)
            ex.final_text = self._final(out.decode(errors="replace"), ex)
        finally:
            log.close()

    async def _end_group(self, proc: asyncio.subprocess.Process) -> None:
        _kill_group(proc.pid, signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(proc.wait()), KILL_GRACE_S)
        _kill_group(proc.pid, signal.SIGKILL)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(proc.wait()), KILL_GRACE_S)

    def _final(self, out: str, ex: CliExecution) -> str | None:
        if self.cfg.agent.harness != "claude-code":
            return out.strip() if (out.strip() or ex.returncode == 0) else None
        lines = out.strip().splitlines()
        try:
            res = json.loads(lines[-1]) if lines else None
        except json.JSONDecodeError:
            return None
        if not isinstance(res, dict):
            return None
        text = res.get("result")
        return text if isinstance(text, str) else ""

    async def settle(self, ex: CliExecution, recorded: Callable[[str], int]) -> None:
        """Count the execution's calls: the records received for it, once stable for SETTLE_S."""
        n, since = recorded(ex.execution_id), time.monotonic()
        deadline = since + 30.0
        while time.monotonic() - since < SETTLE_S and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            m = recorded(ex.execution_id)
            if m != n:
                n, since = m, time.monotonic()
        ex.calls = n

    async def score(self, ex: CliExecution, timed_out: bool, error: str) -> Score:
        if not error and ex.final_text is None and ex.returncode not in (0, None):
            error = f"the harness exited {ex.returncode} (see {ex.root / 'output.log'})"
        try:
            if isinstance(ex.task, coding.CodeTask):
                return await coding.evaluate_code(
                    ex.task, ex.workdir, ex.execution_id, ex.group_id, timed_out, error
                )
            if isinstance(ex.task, DatasetTask):
                assert self.own is not None
                return await self.own.score(ex.task, ex, timed_out, error)
            return qa.evaluate(ex.task, ex.execution_id, ex.group_id, ex.final_text, timed_out, error)
        finally:
            if not self.keep:
                shutil.rmtree(ex.root / "work", ignore_errors=True)
                shutil.rmtree(ex.root / "home", ignore_errors=True)
                shutil.rmtree(ex.root / "tmp", ignore_errors=True)
