"""Built-in task families, their tools, and unit-test scoring with partial scores.

Four families, each with many instances drawn from a seed: `arith` (What is A*B+C? -> calculator),
`weather` (one field of a city's report -> weather), `letters` (letters or vowels of a word -> count) and
`reverse` (a word backwards -> reverse). Every task needs one tool call and then a short answer that
depends on the tool's output. Instances are split by a hash of their arguments into a training split
(rollouts and the warm start's transcripts) and a held-out evaluation split that neither ever sees.

A task's score is the share of its unit tests that pass on the final answer (a bare value in the
expected form; the expected value), so a well-formed wrong answer keeps half the credit. A timed-out
execution is scored on what it produced (flagged `timed_out`); an execution that produced no answer to
evaluate, or whose evaluation itself failed, is an evaluation failure: no value, never a 0.
"""

from __future__ import annotations

import ast
import hashlib
import operator
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from gyre_traj.records import EvalStatus, Score

FAMILIES = ("arith", "weather", "letters", "reverse")
SPLITS = ("train", "eval")
EVAL_SHARE = 5
"""One instance in EVAL_SHARE (by hash of its arguments) belongs to the held-out evaluation split."""


@dataclass(frozen=True)
class ToolStep:
    name: str
    """calculator | weather | count | reverse"""
    argument: str


@dataclass(frozen=True)
class Task:
    task_id: str
    family: str
    prompt: str
    answer: str
    script: tuple[ToolStep, ...]
    """The tool calls the task needs, in order (what the scripted fallback runs for a random model)."""
    slip: tuple[ToolStep, str] = (ToolStep("", ""), "")
    """A plausible mistake of the family (another call or another value copied from the tool's output)
    and the answer it leads to: what the warm start's imperfect teacher sometimes demonstrates."""


def _tool(name: str, description: str, arg: str) -> dict[str, object]:
    schema = {"type": "object", "properties": {arg: {"type": "string"}}, "required": [arg]}
    return {"name": name, "description": description, "input_schema": schema}


TOOLS = [
    _tool("calculator", "+ - * of integers", "expression"),
    _tool("weather", "a city's report", "city"),
    _tool("count", "letters, vowels", "text"),
    _tool("reverse", "a word backwards", "text"),
]
"""What the built-in harness offers the model (Anthropic `tools`), short so prompts stay short."""

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_FIELDS = ("temp", "wind", "rain")


def _arith(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return int(_OPS[type(node.op)](_arith(node.left), _arith(node.right)))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_arith(node.operand)
    raise ValueError("only integers with + - * are allowed")


def _weather(city: str) -> dict[str, int]:
    h = hashlib.blake2b(city.lower().encode(), digest_size=6).digest()
    return {"temp": 5 + h[0] % 30, "wind": 1 + h[1] % 30, "rain": h[2] % 30}


def _vowels(word: str) -> int:
    return sum(ch in _VOWELS for ch in word.lower())


def run_tool(name: str, argument: str) -> tuple[str, bool]:
    """(output, is_error) of one built-in tool; bad input is an error result, never an exception."""
    try:
        if name == "calculator":
            if len(argument) > 200:
                raise ValueError("expression too long")
            return str(_arith(ast.parse(argument, mode="eval").body)), False
        if name == "weather":
            if not argument.strip().isalpha():
                raise ValueError("a city name is letters only")
            w = _weather(argument.strip())
            return ", ".join(f"{k} {w[k]}" for k in _FIELDS), False
        if name == "count":
            word = argument.strip()
            return f"letters {len(word)}, vowels {_vowels(word)}", False
        if name == "reverse":
            return argument[::-1], False
        return f"unknown tool {name!r}", True
    except (ValueError, SyntaxError) as exc:
        return f"error: {exc}", True


def _in_split(key: str, split: str) -> bool:
    held_out = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "big") % EVAL_SHARE == 0
    return held_out == (split == "eval")


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(rng.randint(2, 3)))


def _make_arith(rng: random.Random, tid: str) -> tuple[str, Task]:
    a, b, c = rng.randint(11, 99), rng.randint(2, 9), rng.randint(11, 99)
    full, part = f"{a}*{b}+{c}", f"{a}*{b}"
    task = Task(
        tid, "arith", f"What is {full}?", str(a * b + c),
        (ToolStep("calculator", full),), (ToolStep("calculator", part), str(a * b)),
    )  # fmt: skip
    return f"arith:{a}:{b}:{c}", task


def _make_weather(rng: random.Random, tid: str) -> tuple[str, Task]:
    city = _word(rng).capitalize()
    field = rng.choice(_FIELDS)
    w = _weather(city)
    other = _FIELDS[(_FIELDS.index(field) + 1) % 3]  # one mistake per field, so it is the teacher's mode
    step = ToolStep("weather", city)
    task = Task(
        tid, "weather", f"What is the {field} in {city}?", str(w[field]), (step,), (step, str(w[other]))
    )
    return f"weather:{city}", task


def _make_letters(rng: random.Random, tid: str) -> tuple[str, Task]:
    word = _word(rng)
    field = rng.choice(("letters", "vowels"))
    n = {"letters": len(word), "vowels": _vowels(word)}
    other = "vowels" if field == "letters" else "letters"
    step = ToolStep("count", word)
    task = Task(
        tid, "letters", f"How many {field} are in {word}?", str(n[field]), (step,), (step, str(n[other]))
    )
    return f"letters:{word}", task


def _make_reverse(rng: random.Random, tid: str) -> tuple[str, Task]:
    word = _word(rng)
    step = ToolStep("reverse", word)
    return f"reverse:{word}", Task(
        tid, "reverse", f"Reverse the word {word}.", word[::-1], (step,), (step, word)
    )


_MAKERS: dict[str, Callable[[random.Random, str], tuple[str, Task]]] = {
    "arith": _make_arith,
    "weather": _make_weather,
    "letters": _make_letters,
    "reverse": _make_reverse,
}


def make_task(rng: random.Random, task_id: str, split: str = "train", family: str | None = None) -> Task:
    """A task of `family` (else one drawn from `rng`) from `split`: instances of the other split are
    drawn again, so the evaluation split's instances never reach training."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    fam = family or rng.choice(FAMILIES)
    if fam not in _MAKERS:
        raise ValueError(f"unknown task family {fam!r}; known: {', '.join(FAMILIES)}")
    while True:
        key, task = _MAKERS[fam](rng, task_id)
        if _in_split(key, split):
            return task


def eval_set(n: int, seed: int = 0) -> list[Task]:
    """`n` held-out tasks, the families in turn, the same for a given seed."""
    rng = random.Random(f"gyre-eval-{seed}")
    return [make_task(rng, f"eval-{i:03d}", "eval", FAMILIES[i % len(FAMILIES)]) for i in range(n)]


# ---- scoring -------------------------------------------------------------------------------------

_INT = re.compile(r"-?\d+")
_WORD = re.compile(r"[A-Za-z]+")


def _unit_tests(task: Task) -> list[tuple[str, Callable[[str], bool]]]:
    """(name, check of the stripped final answer) for each unit test of the task."""
    if task.family == "reverse":
        return [
            (
                "one word of the same letters",
                lambda t: bool(_WORD.fullmatch(t)) and sorted(t) == sorted(task.answer),
            ),
            ("the word backwards", lambda t: t == task.answer),
        ]
    return [
        ("a bare integer", lambda t: bool(_INT.fullmatch(t))),
        ("the expected value", lambda t: t == task.answer),
    ]


def unit_tests(task: Task, final_text: str) -> dict[str, bool]:
    """Each unit test's outcome on the final answer (surrounding whitespace and a final '.' ignored)."""
    t = final_text.strip().removesuffix(".").strip()
    return {name: bool(check(t)) for name, check in _unit_tests(task)}


def evaluate(
    task: Task, execution_id: str, group_id: str, final_text: str | None, timed_out: bool, error: str = ""
) -> Score:
    """The execution's Score: the share of unit tests passed, or an evaluation failure."""
    if final_text is None:
        why = error or "no model output to evaluate"
        return Score(execution_id=execution_id, group_id=group_id, status=EvalStatus.EVAL_FAILED, detail=why)
    try:
        results = unit_tests(task, final_text)
    except Exception as exc:  # a broken test is the evaluator's failure, not the model's 0
        return Score(
            execution_id=execution_id,
            group_id=group_id,
            status=EvalStatus.EVAL_FAILED,
            detail=f"evaluation failed: {type(exc).__name__}: {exc}",
        )
    failed = [name for name, ok in results.items() if not ok]
    return Score(
        execution_id=execution_id,
        group_id=group_id,
        value=sum(results.values()) / len(results),
        timed_out=timed_out,
        detail="; ".join([error, *(f"failed: {n}" for n in failed)]).strip("; "),
    )
