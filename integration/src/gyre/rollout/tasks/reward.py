"""Your reward function, as verl's `custom_reward_function`: `fn(data_source, solution_str, ground_truth,
extra_info=None)` named as `module:function` (an importable module) or `path/to/file.py:function`.

It returns a finite number, or a dict whose `score` is one (its other keys with finite numbers are
kept as extras: an evaluation reports their means). Any finite score is a score, on any scale. A reward
that raises, returns anything else (a non-finite number, a dict without `score`, a string) or takes
longer than its timeout is an evaluation failure with the reason in its detail: no value, never a 0.
It runs on a thread of its own, a daemon: a reward that never returns is abandoned there at its timeout,
and neither the event loop's end nor the interpreter's waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import inspect
import math
import numbers
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre_traj.records import EvalStatus, Score

from gyre.rollout.tasks.dataset import DatasetTask


class RewardError(ValueError):
    """The reward function cannot be loaded or called as verl's signature says (the message names it)."""


def load_function(spec: str) -> Callable[..., Any]:
    """The function `spec` names (`module:function` or `file.py:function`), checked to accept
    (data_source, solution_str, ground_truth, extra_info=...)."""
    where, colon, name = spec.rpartition(":")
    if not colon or not where or not name:
        raise RewardError(f"{spec!r}: expected module:function or path/to/file.py:function")
    if where.endswith(".py"):
        path = Path(where).expanduser()
        if not path.is_file():
            raise RewardError(f"{spec!r}: no file {path}")
        mod_name = f"gyre_reward_{path.stem}"
        loader = importlib.util.spec_from_file_location(mod_name, path)
        if loader is None or loader.loader is None:
            raise RewardError(f"{spec!r}: {path} cannot be loaded as a Python module")
        module = importlib.util.module_from_spec(loader)
        sys.modules[mod_name] = module  # what dataclasses and typing in the file expect
        try:
            loader.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(mod_name, None)
            raise RewardError(f"{spec!r}: importing {path} raised {type(exc).__name__}: {exc}") from exc
    else:
        try:
            module = importlib.import_module(where)
        except Exception as exc:
            raise RewardError(f"{spec!r}: importing {where} raised {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, name, None)
    if fn is None:
        raise RewardError(f"{spec!r}: {where} has no {name!r}")
    if not callable(fn):
        raise RewardError(f"{spec!r}: {name} is not a function")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: called as it is
        return fn
    try:
        sig.bind("data_source", "solution_str", "ground_truth", extra_info=None)
    except TypeError as exc:
        raise RewardError(
            f"{spec!r}: {name}{sig} cannot be called as fn(data_source, solution_str, ground_truth, "
            f"extra_info=None): {exc}"
        ) from exc
    return fn


def _finite(v: Any) -> bool:
    return isinstance(v, numbers.Real) and math.isfinite(float(v))


def interpret(result: Any) -> tuple[float, dict[str, float]]:
    """(score, extras) of what a reward returned; `RewardError` saying why it is not a score."""
    if isinstance(result, dict):
        if "score" not in result:
            raise RewardError(f"returned a dict without 'score' (keys: {', '.join(map(str, result))})")
        score = result["score"]
        extras = {str(k): float(v) for k, v in result.items() if k != "score" and _finite(v)}
    else:
        score, extras = result, {}
    if not isinstance(score, numbers.Real):
        raise RewardError(f"returned {type(score).__name__} {score!r:.60}, expected a number")
    if not math.isfinite(float(score)):
        raise RewardError(f"returned {float(score)}, not a finite number")
    return float(score), extras


def _on_a_thread(fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
    """`fn(*args)` on a new daemon thread; its outcome arrives in the returned future (dropped if the
    future was cancelled, or its loop closed, meanwhile)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, exc: BaseException | None) -> None:
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def work() -> None:
        try:
            result, exc = fn(*args), None
        except BaseException as e:  # handed to the awaiting task, which names it
            result, exc = None, e
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, result, exc)

    threading.Thread(target=work, name="reward", daemon=True).start()
    return fut


@dataclass(frozen=True)
class Reward:
    spec: str
    fn: Callable[..., Any]
    timeout_s: float = 60.0

    @classmethod
    def load(cls, spec: str, timeout_s: float = 60.0) -> Reward:
        return cls(spec, load_function(spec), timeout_s)

    async def compute(self, task: DatasetTask, solution: str) -> tuple[float, dict[str, float]]:
        """(score, extras) of `solution`; `RewardError` when the reward fails (raises, times out, or
        returns no finite score)."""
        call = _on_a_thread(self.fn, task.data_source, solution, task.ground_truth, task.extra_info)
        try:
            result = await asyncio.wait_for(call, self.timeout_s)
        except TimeoutError:
            raise RewardError(f"took longer than {self.timeout_s:g} s ([tasks] reward_timeout_s)") from None
        except Exception as exc:
            raise RewardError(f"raised {type(exc).__name__}: {exc}") from exc
        return interpret(result)

    async def score(
        self,
        task: DatasetTask,
        execution_id: str,
        group_id: str,
        final_text: str | None,
        timed_out: bool,
        error: str = "",
    ) -> tuple[Score, dict[str, float]]:
        """The execution's Score (its final text rewarded) and the reward's extras; an evaluation
        failure when there is no text to reward or the reward fails."""
        if final_text is None:
            why = error or "no model output to evaluate"
            return Score(
                execution_id=execution_id, group_id=group_id, status=EvalStatus.EVAL_FAILED, detail=why
            ), {}
        try:
            value, extras = await self.compute(task, final_text)
        except RewardError as exc:
            why = "; ".join(x for x in (error, f"reward {self.spec}: {exc}") if x)
            return Score(
                execution_id=execution_id, group_id=group_id, status=EvalStatus.EVAL_FAILED,
                timed_out=timed_out, detail=why,
            ), {}  # fmt: skip
        detail = "; ".join(x for x in (error, " ".join(f"{k}={v:g}" for k, v in extras.items())) if x)
        return Score(
            execution_id=execution_id, group_id=group_id, value=value, timed_out=timed_out, detail=detail
        ), extras
