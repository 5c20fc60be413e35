"""Coding tasks scored by hidden unit tests run against the execution's working directory.

A `CodeTask` asks for one Python function in `solution.py`; its working directory starts with that file
as a stub (the signature and a docstring, returning None). After the execution, its hidden tests run in
a separate Python process (`python -I`, the working directory on `sys.path`, each test under its own
alarm of `test_timeout_s`), so nothing the agent wrote runs inside `gyre run`. Score = the share of the
tests that pass; a test that raises, fails its assertion or passes its alarm fails. A test run that
cannot run at all (the runner process is killed by the overall timeout, exits without its report, or
cannot start) is an evaluation failure: no value, never a 0. A timed-out execution's working directory
is scored as it was left (flagged `timed_out`).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

from gyre_traj.records import EvalStatus, Score

SOLUTION = "solution.py"
TOOLS = ("Read", "Write")
"""Claude Code's tools a coding task allows (its per-task allow-list: `--tools` and `--allowedTools`).
Two, because every tool's schema is in every prompt: with Read, Write, Edit and Bash, Claude Code's
call was about 8,450 tokens of the embedded tokenizer (Bash's schema alone about 1,700), with these two
the first call is 4,764, and training cost on the CPU grows faster than that (107 s against 15-20 s a
step here)."""


@dataclass(frozen=True)
class CodeTask:
    task_id: str
    family: str
    prompt: str
    files: tuple[tuple[str, str], ...]
    """(relative path, content) put in the working directory before the agent starts."""
    tests: tuple[tuple[str, str], ...]
    """Hidden tests: (name, Python statements run after `from solution import *`)."""
    tools: tuple[str, ...] = TOOLS


@dataclass(frozen=True)
class _Family:
    signature: str
    doc: str
    tests: tuple[str, ...]


_FAMILIES = {
    "add": _Family(
        "add(a, b)", "the sum of a and b", ("add(2, 3) == 5", "add(-1, 1) == 0", "add(10, 0) == 10")
    ),
    "clamp": _Family(
        "clamp(x, lo, hi)",
        "x limited to the range [lo, hi]",
        ("clamp(5, 0, 3) == 3", "clamp(-2, 0, 3) == 0", "clamp(2, 0, 3) == 2"),
    ),
    "vowels": _Family(
        "vowels(word)",
        "how many of the letters of word are a, e, i, o or u",
        ("vowels('banana') == 3", "vowels('sky') == 0", "vowels('queue') == 4"),
    ),
    "reverse_words": _Family(
        "reverse_words(text)",
        "the words of text in reverse order, joined by single spaces",
        (
            "reverse_words('a b c') == 'c b a'",
            "reverse_words('one') == 'one'",
            "reverse_words('x  y') == 'y x'",
        ),
    ),
}
FAMILIES = tuple(_FAMILIES)


def make_code_task(rng: random.Random, task_id: str, family: str | None = None) -> CodeTask:
    """A coding task of `family` (else one drawn from `rng`)."""
    fam = family or rng.choice(FAMILIES)
    if fam not in _FAMILIES:
        raise ValueError(f"unknown coding task family {fam!r}; known: {', '.join(FAMILIES)}")
    f = _FAMILIES[fam]
    name = f.signature.split("(")[0]
    prompt = f"In {SOLUTION}, write the function {f.signature} that returns {f.doc}."
    stub = f'def {f.signature}:\n    """Return {f.doc}."""\n    return None\n'
    tests = tuple((f"{name}_{i}", f"assert {t}") for i, t in enumerate(f.tests))
    return CodeTask(task_id, fam, prompt, ((SOLUTION, stub),), tests)


def populate(task: CodeTask, workdir: Path) -> None:
    """Write the task's files into a fresh working directory."""
    for rel, content in task.files:
        p = workdir / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(content)


_RUNNER = """
import json, signal, sys
spec = json.loads(sys.stdin.read())
sys.path.insert(0, spec["workdir"])
def alarm(*_):
    raise TimeoutError("test took longer than its alarm")
signal.signal(signal.SIGALRM, alarm)
results = {}
for name, code in spec["tests"]:
    signal.setitimer(signal.ITIMER_REAL, spec["timeout_s"])
    try:
        ns = {}
        exec("from solution import *\\n" + code, ns)
        results[name] = True
    except BaseException:
        results[name] = False
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
sys.stdout.write("\\n" + json.dumps(results) + "\\n")
"""


class TestRunFailed(RuntimeError):
    """The hidden tests could not run at all (an evaluation failure, not a 0)."""


async def run_tests(task: CodeTask, workdir: Path, test_timeout_s: float = 2.0) -> dict[str, bool]:
    """Each hidden test's outcome on `workdir`; `TestRunFailed` if the run itself failed."""
    spec = {"workdir": str(workdir), "tests": list(task.tests), "timeout_s": test_timeout_s}
    limit = test_timeout_s * len(task.tests) + 10.0
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-c", _RUNNER,
            cwd=workdir, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
    except OSError as exc:
        raise TestRunFailed(f"cannot start the test runner: {exc}") from exc
    try:
        out, err = await asyncio.wait_for(proc.communicate(json.dumps(spec).encode()), limit)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise TestRunFailed(f"the test run passed its overall timeout ({limit:.0f} s)") from None
    lines = out.decode(errors="replace").strip().splitlines()
    try:
        results = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        results = None
    if proc.returncode != 0 or not isinstance(results, dict) or set(results) != {n for n, _ in task.tests}:
        tail = err.decode(errors="replace")[-300:]
        raise TestRunFailed(f"the test runner exited {proc.returncode} without its report: {tail}")
    return {str(k): bool(v) for k, v in results.items()}


async def evaluate_code(
    task: CodeTask, workdir: Path, execution_id: str, group_id: str, timed_out: bool, error: str = ""
) -> Score:
    """The execution's Score: the share of hidden tests passing on its working directory, or an
    evaluation failure when they cannot run."""
    try:
        results = await run_tests(task, workdir)
    except TestRunFailed as exc:
        why = "; ".join(x for x in (error, f"evaluation failed: {exc}") if x)
        return Score(execution_id=execution_id, group_id=group_id, status=EvalStatus.EVAL_FAILED, detail=why)
    failed = [n for n, ok in results.items() if not ok]
    return Score(
        execution_id=execution_id,
        group_id=group_id,
        value=sum(results.values()) / len(results),
        timed_out=timed_out,
        detail="; ".join([error, *(f"failed: {n}" for n in failed)]).strip("; "),
    )
