"""Built-in tasks and their evaluator, with partial scoring.

A task is a prompt, the answer the evaluator expects and the tool calls the scripted harness makes for
it. `evaluate` scores the final assistant text in [0, 1]: the longest run of the expected answer found in
it, as a share of the answer (so "4" against "42" is 0.5, not 0); a timed-out execution is scored the
same way on what it produced, flagged `timed_out`; an execution that cannot be evaluated (it produced no
text because every call failed) is an evaluation failure, never a 0 (gyre-traj's `Score` rules).
"""

from __future__ import annotations

import ast
import difflib
import operator
import random
from dataclasses import dataclass

from gyre_traj.records import EvalStatus, Score


@dataclass(frozen=True)
class ToolStep:
    name: str
    """calculator | reverse | count"""
    argument: str


@dataclass(frozen=True)
class Task:
    task_id: str
    prompt: str
    answer: str
    script: tuple[ToolStep, ...]
    """The tool calls the scripted harness makes, in order, one per turn (then it asks for the answer)."""


TOOLS = [
    {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * and integers.",
        "input_schema": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
    {
        "name": "reverse",
        "description": "Reverse a word.",
        "input_schema": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    },
    {
        "name": "count",
        "description": "Count the vowels in a word.",
        "input_schema": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    },
]

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_WORDS = ("gyre", "policy", "rollout", "tensor", "agent", "cluster", "gradient", "engine", "harness")


def _arith(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return int(_OPS[type(node.op)](_arith(node.left), _arith(node.right)))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_arith(node.operand)
    raise ValueError("only integers with + - * are allowed")


def run_tool(name: str, argument: str) -> tuple[str, bool]:
    """(output, is_error) of one built-in tool; bad input is an error result, never an exception."""
    try:
        if name == "calculator":
            if len(argument) > 200:
                raise ValueError("expression too long")
            return str(_arith(ast.parse(argument, mode="eval").body)), False
        if name == "reverse":
            return argument[::-1], False
        if name == "count":
            return str(sum(ch in "aeiou" for ch in argument.lower())), False
        return f"unknown tool {name!r}", True
    except (ValueError, SyntaxError) as exc:
        return f"error: {exc}", True


def make_task(rng: random.Random, task_id: str) -> Task:
    kind = rng.choice(("sum", "reverse", "vowels"))
    if kind == "sum":
        a, b, c = rng.randint(10, 99), rng.randint(10, 99), rng.randint(2, 9)
        expr = f"{a}+{b}"
        return Task(
            task_id,
            f"What is ({a} + {b}) * {c}? Use the calculator, then answer with the number only.",
            str((a + b) * c),
            (ToolStep("calculator", expr), ToolStep("calculator", f"{a + b}*{c}")),
        )
    word = rng.choice(_WORDS)
    if kind == "reverse":
        return Task(
            task_id,
            f"Reverse the word '{word}' and answer with it only.",
            word[::-1],
            (ToolStep("reverse", word),),
        )
    n = sum(ch in "aeiou" for ch in word)
    return Task(
        task_id,
        f"How many vowels are in '{word}'? Answer with the number.",
        str(n),
        (ToolStep("count", word),),
    )


def partial_score(answer: str, text: str) -> float:
    """Longest run of `answer` found inside `text`, as a share of `answer` (1.0 = the answer appears)."""
    if not answer:
        raise ValueError("a task needs a non-empty answer")
    m = difflib.SequenceMatcher(None, answer, text, autojunk=False).find_longest_match(
        0, len(answer), 0, len(text)
    )
    return m.size / len(answer)


def evaluate(
    task: Task, execution_id: str, group_id: str, final_text: str | None, timed_out: bool, error: str = ""
) -> Score:
    """The execution's Score: partial credit on its final text, or an evaluation failure without one."""
    if final_text is None:
        why = error or "no model output to evaluate"
        return Score(execution_id=execution_id, group_id=group_id, status=EvalStatus.EVAL_FAILED, detail=why)
    return Score(
        execution_id=execution_id,
        group_id=group_id,
        value=partial_score(task.answer, final_text),
        timed_out=timed_out,
        detail=error,
    )
