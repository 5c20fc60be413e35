"""Built-in task families, their tools, and unit-test scoring with partial scores.

Two families, each with many instances drawn from a seed. `measure`: "How old is the anvil?" -> the
`get` tool with `{"key": "age"}` (its keys: size, age, length); `calc`: "What is the larger of 7 and
3?" -> the `calc` tool with `{"op": "max"}` (its ops: add, sub, max). What the call must get right is one
categorical decision, which of its tool's three choices the question asks for (the cue word: old, larger;
the first choice is the tool's default, which no question asks for); the thing the question is about
(the object, the two numbers) is the task's state, which the tool reads, so nothing has to be copied
into the call. The answer is the tool's result, copied. (`Family.cues` can map several cue words to
choices; a family that asks for one choice per question kind is what a model of a million parameters
learns in a few RL steps; with three cue words per family it had not learned them after 20, measured
offline.)

Instances are split into a training split (rollouts and the warm start's transcripts) and a held-out
evaluation split that neither ever sees: a quarter of the objects and number pairs (by hash; 18 of the
48 objects and 4 of the 16 pairs) and one of the four phrasings of each family appear only in
evaluation questions.

A task's score is the share of its two unit tests that pass: the first tool call the model made
itself is the family's tool with the question's choice, and the final answer (a bare value) is the
expected one. The three choices of a question lead to three different values, so a model that copies
the tool's result passes both or neither; one that makes the right call but does not copy the result
keeps half the credit. A timed-out execution is scored on what it produced (flagged `timed_out`); an
execution that produced no answer to evaluate, or whose evaluation itself failed, is an
evaluation failure: no value, never a 0.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from gyre_traj.records import EvalStatus, Score

SPLITS = ("train", "eval")
EVAL_SHARE = 4
"""One object or number pair in EVAL_SHARE (by hash) is held out: it appears only in evaluation
questions."""


@dataclass(frozen=True)
class Family:
    name: str
    tool: str
    """The tool this family's questions need."""
    param: str
    """The name of the tool's one argument (the decision)."""
    choices: tuple[str, ...]
    """The argument's values; the first is the family's default (what a call makes unless asked)."""
    cues: tuple[tuple[str, str], ...]
    """(the word in the question, the choice it asks for) of each kind of question the family asks."""
    templates: tuple[str, ...]
    """Phrasings of a question ({cue} and the subject's fields); the last is held out."""
    description: str
    """The tool's line in the system prompt."""

    def choice_of(self, cue: str) -> str:
        return dict(self.cues)[cue]


MEASURE = Family(
    "measure", "get", "key", ("size", "age", "length"), (("old", "age"),),
    (
        "How {cue} is the {obj}?",
        "Tell me how {cue} the {obj} is.",
        "The {obj}: how {cue} is it?",
        "I wonder how {cue} the {obj} is.",
    ),
    "size, age or length of the thing asked about",
)  # fmt: skip
CALC = Family(
    "calc", "calc", "op", ("add", "sub", "max"), (("larger", "max"),),
    (
        "What is the {cue} of {x} and {y}?",
        "Find the {cue} of {x} and {y}.",
        "Of {x} and {y}, give the {cue}.",
        "Take {x} and {y}: what is the {cue}?",
    ),
    "add, sub or max of the two numbers",
)  # fmt: skip
FAMILY = {f.name: f for f in (MEASURE, CALC)}
FAMILIES = tuple(FAMILY)

_OBJECT_WORDS = (
    "anvil apple barrel basket bottle bridge bucket cabin candle canoe castle chair clock crate desk "
    "drum engine fence garden hammer helmet island kettle ladder lamp lantern mirror needle oven pencil "
    "piano pillow rocket saddle shovel statue table tent tower tractor trumpet tunnel violin wagon wallet "
    "window barn raft"
)
OBJECTS = tuple(_OBJECT_WORDS.split(" "))
"""The objects of `measure` questions (48; a quarter held out)."""
PAIRS = tuple((x, y) for x in range(2, 9) for y in range(1, min(x, 10 - x)))
"""The number pairs of `calc` questions, larger first, whose sum is a digit (16; a quarter held out); a
question may name them in either order. With y >= 1 the sum, difference and larger of a pair all
differ, and every answer is one digit (one token of the embedded tokenizer, as the measures are)."""


@dataclass(frozen=True)
class ToolStep:
    name: str
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
    subject: tuple[str, ...]
    """What the question is about, which the tool reads: (object,) or the two numbers as named."""
    cue: str
    template: int
    """Which phrasing of the family (the last is held out)."""

    @property
    def fam(self) -> Family:
        return FAMILY[self.family]

    @property
    def choice(self) -> str:
        """The right value of the call's argument (the decision)."""
        return self.fam.choice_of(self.cue)

    def call(self, choice: str) -> ToolStep:
        """The family's well-formed call with `choice` as its argument."""
        return ToolStep(self.fam.tool, ((self.fam.param, choice),))

    @property
    def script(self) -> tuple[ToolStep, ...]:
        """The tool calls the task needs (what the scripted fallback runs for a random model)."""
        return (self.call(self.choice),)

    @property
    def answer(self) -> str:
        return run_tool(self, self.fam.tool, {self.fam.param: self.choice})[0]


def _tool_lines() -> str:
    return "; ".join(f"{f.tool}({f.param}): {f.description}" for f in FAMILY.values())


TOOL_LINE = _tool_lines()
"""The built-in tools in one line (the harness's system prompt lists them)."""


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "big")


def _measure(obj: str, key: str) -> int:
    """The object's `key`: a digit, the three keys of one object all different."""
    digits = list(range(10))
    random.Random(_digest(f"measure/{obj}")).shuffle(digits)
    return digits[MEASURE.choices.index(key)]


def _calc(x: int, y: int, op: str) -> int:
    return {"add": x + y, "sub": abs(x - y), "max": max(x, y)}[op]


def run_tool(task: Task, name: str, args: Mapping[str, object]) -> tuple[str, bool]:
    """(output, is_error) of one built-in tool on the task's state; bad input is an error result, never
    an exception."""
    fam = next((f for f in FAMILY.values() if f.tool == name), None)
    if fam is None:
        return f"error: unknown tool {name!r}", True
    value = str(args.get(fam.param, "")).strip()
    if value not in fam.choices:
        return f"error: {fam.param} is one of {', '.join(fam.choices)}", True
    if fam is not task.fam:
        return f"error: {name} does not apply to this question", True
    if fam is MEASURE:
        return str(_measure(task.subject[0], value)), False
    x, y = (int(v) for v in task.subject)
    return str(_calc(x, y, value)), False


def _held_out(family: str, subject: tuple[str, ...]) -> bool:
    return _digest(f"{family}:{':'.join(sorted(subject))}") % EVAL_SHARE == 0


def _instance(fam: Family, subject: tuple[str, ...], cue: str, template: int, task_id: str) -> Task:
    fields = (
        {"cue": cue, "obj": subject[0]} if fam is MEASURE else {"cue": cue, "x": subject[0], "y": subject[1]}
    )
    return Task(task_id, fam.name, fam.templates[template].format(**fields), subject, cue, template)


def _subject(fam: Family, rng: random.Random) -> tuple[str, ...]:
    if fam is MEASURE:
        return (rng.choice(OBJECTS),)
    x, y = rng.choice(PAIRS)
    return (str(x), str(y)) if rng.random() < 0.5 else (str(y), str(x))


def make_task(
    rng: random.Random, task_id: str, split: str = "train", family: str | None = None, cue: str | None = None
) -> Task:
    """A task of `family` (else one drawn from `rng`) from `split`: the training split's subjects and
    phrasings, or the held-out subjects (in any phrasing) for "eval"."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    fam = FAMILY.get(family or rng.choice(FAMILIES))
    if fam is None:
        raise ValueError(f"unknown task family {family!r}; known: {', '.join(FAMILIES)}")
    held = split == "eval"
    phrasings = len(fam.templates) if held else len(fam.templates) - 1
    while True:
        subject = _subject(fam, rng)
        if _held_out(fam.name, subject) == held:
            break
    cue = cue or rng.choice(fam.cues)[0]
    return _instance(fam, subject, cue, rng.randrange(phrasings), task_id)


def eval_set(n: int, seed: int = 0) -> list[Task]:
    """`n` distinct held-out tasks, the families and their cues in turn (so a policy that ignores the
    cue gets one decision in three right), the same for a given seed."""
    rng = random.Random(f"gyre-eval-{seed}")
    out: list[Task] = []
    seen: set[str] = set()
    for i in range(n):
        fam = FAMILY[FAMILIES[i % len(FAMILIES)]]
        cue = fam.cues[(i // len(FAMILIES)) % len(fam.cues)][0]
        for _ in range(1000):  # distinct questions while the family has unused ones
            t = make_task(rng, f"eval-{i:03d}", "eval", fam.name, cue)
            if t.prompt not in seen:
                break
        seen.add(t.prompt)
        out.append(t)
    return out


# ---- scoring -------------------------------------------------------------------------------------

ToolCall = tuple[str, Mapping[str, object]]
"""(tool name, arguments) of a tool call the model made itself."""


def _unit_tests(task: Task) -> list[tuple[str, Callable[[str, Sequence[ToolCall]], bool]]]:
    """(name, check of the stripped final answer and the model's own tool calls) for each unit test."""
    fam = task.fam

    def cued(calls: Sequence[ToolCall]) -> bool:
        if not calls:
            return False
        name, args = calls[0]
        return name == fam.tool and str(args.get(fam.param, "")).strip() == task.choice

    return [
        (f"the call asks for the question's {fam.param}", lambda t, c: cued(c)),
        ("the expected value", lambda t, c: t == task.answer),
    ]


def unit_tests(task: Task, final_text: str, calls: Sequence[ToolCall] = ()) -> dict[str, bool]:
    """Each unit test's outcome on the final answer (surrounding whitespace and a final '.' ignored) and
    the tool calls the model made itself, in order (a scripted call is not the model's)."""
    t = final_text.strip().removesuffix(".").strip()
    return {name: bool(check(t, calls)) for name, check in _unit_tests(task)}


def evaluate(
    task: Task,
    execution_id: str,
    group_id: str,
    final_text: str | None,
    timed_out: bool,
    error: str = "",
    calls: Sequence[ToolCall] = (),
) -> Score:
    """The execution's Score: the share of unit tests passed, or an evaluation failure."""
    if final_text is None:
        why = error or "no model output to evaluate"
        return Score(execution_id=execution_id, group_id=group_id, status=EvalStatus.EVAL_FAILED, detail=why)
    try:
        results = unit_tests(task, final_text, calls)
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
