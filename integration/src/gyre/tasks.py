"""Built-in task families, their tools, and unit-test scoring with partial scores.

Three families, each with many instances drawn from a seed: `lookup` (a field of a record -> lookup),
`minmax` (the max or the low of two digits -> calc) and `count` (the length or the vowel count of a word
-> count). Every task needs one tool call whose arguments come from the question (an item or word, a
key or mode), then an answer copied from the tool's output; the family's plausible mistake is the call
with the other key or mode. Instances are split by a hash of their arguments into a training split
(rollouts and the warm start's transcripts) and a held-out evaluation split that neither ever sees.

A task's score is the share of its unit tests that pass on the final answer (a bare value in the
expected form; the expected value), so a well-formed wrong answer keeps half the credit. A timed-out
execution is scored on what it produced (flagged `timed_out`); an execution that produced no answer to
evaluate, or whose evaluation itself failed, is an evaluation failure: no value, never a 0.
"""

from __future__ import annotations

import functools
import hashlib
import random
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gyre_traj.records import EvalStatus, Score

FAMILIES = ("lookup", "minmax", "count")
SPLITS = ("train", "eval")
EVAL_SHARE = 4
"""One instance in EVAL_SHARE (by hash of its whole question: item or digits, and key or mode) belongs to
the held-out evaluation split: a held-out question was never trained on, though its item and its key
each appear in training in other questions."""


@dataclass(frozen=True)
class ToolStep:
    name: str
    """lookup | calc | count"""
    args: tuple[tuple[str, str], ...]
    """The call's arguments, in order (JSON object keys and string values)."""

    @property
    def arguments(self) -> dict[str, str]:
        return dict(self.args)


@dataclass(frozen=True)
class Task:
    task_id: str
    family: str
    prompt: str
    answer: str
    script: tuple[ToolStep, ...]
    """The tool calls the task needs, in order (what the scripted fallback runs for a random model)."""
    slip: tuple[ToolStep, str]
    """A plausible mistake of the family (the call with the other key or mode) and the answer it leads
    to: what the warm start's imperfect teacher sometimes demonstrates."""


def _tool(name: str, description: str, *args: str) -> dict[str, object]:
    schema = {"type": "object", "properties": {a: {"type": "string"} for a in args}, "required": list(args)}
    return {"name": name, "description": description, "input_schema": schema}


TOOLS = [
    _tool("lookup", "a record's field", "item", "key"),
    _tool("calc", "max or low of two digits", "a", "b", "mode"),
    _tool("count", "len or vowel count of a word", "word", "field"),
]
"""What the built-in harness offers the model (Anthropic `tools`), short so prompts stay short."""

_KEYS = ("size", "age", "value")
_MODES = ("max", "low")
_FIELDS = ("len", "count")


ENTITIES = 40
"""Items and words in use: each is seen often enough in training for a 1M-parameter model to copy it."""


@functools.cache
def entities() -> tuple[str, ...]:
    """Item names and words: `ENTITIES` lowercase words of 4-8 letters, spread over those that are one
    token of the embedded model's tokenizer (gyre-engine's, trained locally)."""
    from gyre_engine.tokenizer import train_bpe

    vocab = train_bpe(2048).get_vocab()
    words = sorted(w for w in vocab if w.isalpha() and w.islower() and 4 <= len(w) <= 8)
    return tuple(words[:: max(1, len(words) // ENTITIES)][:ENTITIES])


def _lookup(item: str, key: str) -> int:
    return hashlib.blake2b(f"{item}/{key}".encode(), digest_size=2).digest()[0] % 10


def _vowels(word: str) -> int:
    return sum(ch in "aeiou" for ch in word)


def run_tool(name: str, args: Mapping[str, object]) -> tuple[str, bool]:
    """(output, is_error) of one built-in tool; bad input is an error result, never an exception."""
    a = {k: str(v).strip() for k, v in args.items()}
    try:
        if name == "lookup":
            if a.get("key") not in _KEYS or not a.get("item", "").isalpha():
                raise ValueError(f"key is one of {', '.join(_KEYS)}; item is a word")
            return str(_lookup(a["item"], a["key"])), False
        if name == "calc":
            x, y = int(a.get("a", "")), int(a.get("b", ""))
            if a.get("mode") not in _MODES:
                raise ValueError(f"mode is one of {', '.join(_MODES)}")
            return str(max(x, y) if a["mode"] == "max" else min(x, y)), False
        if name == "count":
            word, field = a.get("word", ""), a.get("field")
            if field not in _FIELDS or not word.isalpha():
                raise ValueError(f"field is one of {', '.join(_FIELDS)}; word is a word")
            return str(len(word) if field == "len" else _vowels(word)), False
        return f"unknown tool {name!r}", True
    except ValueError as exc:
        return f"error: {exc}", True


def _in_split(key: str, split: str) -> bool:
    held_out = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "big") % EVAL_SHARE == 0
    return held_out == (split == "eval")


def _task(tid: str, fam: str, prompt: str, name: str, right: dict[str, str], wrong: dict[str, str]) -> Task:
    good, bad = ToolStep(name, tuple(right.items())), ToolStep(name, tuple(wrong.items()))
    return Task(tid, fam, prompt, run_tool(name, right)[0], (good,), (bad, run_tool(name, wrong)[0]))


def _make_lookup(rng: random.Random, tid: str) -> tuple[str, Task]:
    item, k = rng.choice(entities()), rng.randrange(3)
    key, other = _KEYS[k], _KEYS[(k + 1) % 3]  # one mistake per key, so it is the teacher's mode
    prompt = f'What is the "{key}" of "{item}"?'
    return f"lookup:{item}:{key}", _task(
        tid, "lookup", prompt, "lookup", {"item": item, "key": key}, {"item": item, "key": other}
    )


def _make_minmax(rng: random.Random, tid: str) -> tuple[str, Task]:
    x, y = rng.sample(range(10), 2)
    m = rng.randrange(2)
    mode, other = _MODES[m], _MODES[1 - m]
    prompt = f'What is the "{mode}" of "{x}" and "{y}"?'
    right, wrong = {"a": str(x), "b": str(y), "mode": mode}, {"a": str(x), "b": str(y), "mode": other}
    return f"minmax:{x}:{y}:{mode}", _task(tid, "minmax", prompt, "calc", right, wrong)


def _make_count(rng: random.Random, tid: str) -> tuple[str, Task]:
    word, f = rng.choice(entities()), rng.randrange(2)
    field, other = _FIELDS[f], _FIELDS[1 - f]
    prompt = f'What is the "{field}" of "{word}"?'
    return f"count:{word}:{field}", _task(
        tid, "count", prompt, "count", {"word": word, "field": field}, {"word": word, "field": other}
    )


_MAKERS: dict[str, Callable[[random.Random, str], tuple[str, Task]]] = {
    "lookup": _make_lookup,
    "minmax": _make_minmax,
    "count": _make_count,
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
    out: list[Task] = []
    seen: set[str] = set()
    for i in range(n):
        for _ in range(1000):  # distinct questions while the family has unused ones
            t = make_task(rng, f"eval-{i:03d}", "eval", FAMILIES[i % len(FAMILIES)])
            if t.prompt not in seen:
                break
        seen.add(t.prompt)
        out.append(t)
    return out


# ---- scoring -------------------------------------------------------------------------------------

_INT = re.compile(r"-?\d+")


def _unit_tests(task: Task) -> list[tuple[str, Callable[[str], bool]]]:
    """(name, check of the stripped final answer) for each unit test of the task."""
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
