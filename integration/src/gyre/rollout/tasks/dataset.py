"""Your own tasks: rows of a dataset in verl's column conventions, split into training and evaluation.

A row has `prompt` (a non-empty list of chat messages, each {role, content}: role system, developer,
user or assistant, content a string), `reward_model` (a table with `ground_truth`, of any type),
`data_source` (a string: the reward function's first argument, and the family an evaluation reports
scores by) and optionally `extra_info` (anything; passed to the reward function as it is). Other columns
are ignored. A row that breaks this is a `DataError` naming the file, the row and the column.

The evaluation split is a file of its own (`[tasks] eval`) or a held-out share of the training rows
(`[tasks] eval_fraction`), chosen by a hash of each row's prompt: a question and its duplicates fall
on one side, and the split does not move when rows are added or reordered. Training draws the rows in
a shuffled order, epoch after epoch (`Cursor`), the same for a given seed.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gyre.config.runconfig import TasksSection
from gyre.rollout.tasks.rows import DataError, read_rows

ROLES = ("system", "developer", "user", "assistant")


@dataclass(frozen=True)
class DatasetTask:
    task_id: str
    messages: tuple[tuple[str, str], ...]
    """The prompt: (role, content) of each chat message, in order."""
    ground_truth: Any
    data_source: str
    extra_info: Any = None
    where: str = ""
    """The file and row it came from."""

    @property
    def family(self) -> str:
        """What an evaluation reports scores by: the row's data_source."""
        return self.data_source

    @property
    def prompt(self) -> str:
        """The prompt as one text (what a command-line harness is given): the messages' contents, in
        order, a blank line between them."""
        return "\n\n".join(c for _, c in self.messages)

    def chat(self) -> list[dict[str, str]]:
        """The prompt as OpenAI chat messages."""
        return [{"role": r, "content": c} for r, c in self.messages]


def task_from_row(row: dict[str, Any], where: str, task_id: str) -> DatasetTask:
    """The task of one row, checked (module docstring); `DataError` naming `where` and the column."""

    def bad(column: str, why: str) -> DataError:
        return DataError(f"{where}: column {column!r} {why}")

    if "prompt" not in row:
        raise bad("prompt", "is missing (a list of chat messages, {role, content})")
    prompt = row["prompt"]
    if not isinstance(prompt, list) or not prompt:
        raise bad("prompt", f"must be a non-empty list of chat messages, got {_short(prompt)}")
    messages = []
    for i, m in enumerate(prompt):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise bad(f"prompt[{i}]", f"must be a message with role and content, got {_short(m)}")
        if m["role"] not in ROLES:
            raise bad(f"prompt[{i}].role", f"must be one of {', '.join(ROLES)}, got {_short(m['role'])}")
        if not isinstance(m["content"], str):
            raise bad(f"prompt[{i}].content", f"must be a string, got {_short(m['content'])}")
        messages.append((str(m["role"]), m["content"]))
    rm = row.get("reward_model")
    if rm is None:
        raise bad("reward_model.ground_truth", "is missing")
    if not isinstance(rm, dict):
        raise bad("reward_model", f"must be a table with ground_truth, got {_short(rm)}")
    if "ground_truth" not in rm:
        raise bad("reward_model.ground_truth", "is missing")
    if "data_source" not in row:
        raise bad("data_source", "is missing (a string the reward function is given)")
    if not isinstance(row["data_source"], str):
        raise bad("data_source", f"must be a string, got {_short(row['data_source'])}")
    return DatasetTask(
        task_id, tuple(messages), rm["ground_truth"], row["data_source"], row.get("extra_info"), where
    )


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def read_tasks(path: str) -> list[DatasetTask]:
    """Every row of the dataset at `path` as a task (`DataError` on the first bad one, or none)."""
    tasks = [task_from_row(row, where, f"row-{i}") for i, (where, row) in enumerate(read_rows(path))]
    if not tasks:
        raise DataError(f"{path}: no rows")
    return tasks


def held_out(task: DatasetTask, fraction: float) -> bool:
    """Whether `task` belongs to the evaluation share `fraction` (by a hash of its prompt)."""
    key = json.dumps(task.messages, ensure_ascii=False).encode()
    h = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")
    return h / 2**64 < fraction


@dataclass(frozen=True)
class TaskSet:
    train: tuple[DatasetTask, ...]
    eval: tuple[DatasetTask, ...]


def load_tasks(t: TasksSection) -> TaskSet:
    """The training and evaluation tasks `[tasks]` names (`DataError` naming the file and the row)."""
    rows = read_tasks(t.train)
    if t.eval:
        return TaskSet(tuple(rows), tuple(read_tasks(t.eval)))
    if not t.eval_fraction:
        return TaskSet(tuple(rows), ())
    train = tuple(r for r in rows if not held_out(r, t.eval_fraction))
    evals = tuple(r for r in rows if held_out(r, t.eval_fraction))
    if not train or not evals:
        side = "training" if not train else "evaluation"
        raise DataError(
            f"{t.train}: [tasks] eval_fraction = {t.eval_fraction} leaves no {side} rows of {len(rows)} "
            "(the split is by a hash of each prompt): give more rows or another fraction"
        )
    return TaskSet(train, evals)


def eval_subset(tasks: Sequence[DatasetTask], n: int, seed: int) -> list[DatasetTask]:
    """`n` of the evaluation tasks (all of them when there are no more), chosen by `seed`, in file
    order; the same at every evaluation."""
    if n >= len(tasks):
        return list(tasks)
    keep = sorted(random.Random(f"gyre-eval-{seed}").sample(range(len(tasks)), n))
    return [tasks[i] for i in keep]


class Cursor:
    """The training tasks in a shuffled order (a new one each epoch, from `seed`), one after another."""

    def __init__(self, tasks: Sequence[DatasetTask], seed: int) -> None:
        if not tasks:
            raise ValueError("no training tasks")
        self.tasks = tuple(tasks)
        self.seed = seed
        self.epoch = 0
        self._order: list[int] = []

    def next(self) -> DatasetTask:
        if not self._order:
            self._order = list(range(len(self.tasks)))
            random.Random(f"gyre-tasks-{self.seed}-{self.epoch}").shuffle(self._order)
            self._order.reverse()  # popped from the end: the shuffled order, first to last
            self.epoch += 1
        return self.tasks[self._order.pop()]
