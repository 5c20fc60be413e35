"""A property of every reader: the same agent executions, written as a slime sample file, as verl dump
rows, as a log of vLLM chat responses, or as gyre's own records, read to the same forest: the same
tokens, the same policy tokens with the same logprobs and versions, the same scores in the same groups.

Executions are drawn by hypothesis: groups sharing a prompt, each execution some turns (the model's
output, then tool output as context), sometimes trailing tool output the policy never saw (left out by
the row readers), sometimes no turn at all; rewards anywhere on the float64 line."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gyre_traj.io import Record, read_records, write_records
from gyre_traj.readers import iter_messages, iter_slime, iter_verl
from gyre_traj.records import Call, Role, Score
from gyre_traj.tree import Forest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

_ids = st.lists(st.integers(0, 50_000), min_size=1, max_size=5)
_logprob = st.floats(-20.0, 0.0, allow_nan=False)


@dataclass(frozen=True)
class Turn:
    output: list[int]
    logprobs: list[float]
    context: list[int]
    """Tool output after the model's turn (empty only after the last turn)."""


@dataclass(frozen=True)
class Execution:
    group: int
    prompt: list[int]
    turns: list[Turn]
    trailing: list[int]
    """Tool output after the last turn that no later call saw."""
    reward: float
    version: int


@st.composite
def _turn(draw: st.DrawFn, last: bool) -> Turn:
    out = draw(_ids)
    ctx = [] if last else draw(_ids)
    return Turn(out, draw(st.lists(_logprob, min_size=len(out), max_size=len(out))), ctx)


@st.composite
def executions(draw: st.DrawFn) -> list[Execution]:
    out: list[Execution] = []
    for group in range(draw(st.integers(1, 2))):
        prompt = draw(_ids)  # one prompt per group, as GRPO samples it
        for _ in range(draw(st.integers(1, 3))):
            n = draw(st.integers(0, 3))
            turns = [draw(_turn(last=k == n - 1)) for k in range(n)]
            trailing = draw(_ids) if n and draw(st.booleans()) else []
            reward = draw(st.floats(allow_nan=False, allow_infinity=False))
            out.append(Execution(group, prompt, turns, trailing, reward, draw(st.integers(0, 2**31 - 1))))
    return out


def _response(e: Execution) -> tuple[list[int], list[int], list[float]]:
    """(response ids, mask, logprobs with 0.0 on inserted tokens), as slime and verl keep a trajectory."""
    ids: list[int] = []
    mask: list[int] = []
    lps: list[float] = []
    for t in e.turns:
        ids += t.output + t.context
        mask += [1] * len(t.output) + [0] * len(t.context)
        lps += t.logprobs + [0.0] * len(t.context)
    return ids + e.trailing, mask + [0] * len(e.trailing), lps + [0.0] * len(e.trailing)


def _inputs(e: Execution) -> list[list[int]]:
    """Each call's whole input."""
    seen, out = list(e.prompt), []
    for t in e.turns:
        out.append(list(seen))
        seen += t.output + t.context
    return out or [list(e.prompt)]


def gyre_records(execs: list[Execution]) -> list[Record]:
    """The reference: one `Call` per turn with its whole input, one `Score` per execution."""
    recs: list[Record] = []
    for k, e in enumerate(execs):
        turns = e.turns or [Turn([], [], [])]
        for j, (inp, t) in enumerate(zip(_inputs(e), turns, strict=True)):
            recs.append(
                Call(
                    execution_id=f"e{k}",
                    call_id=f"c{j}",
                    agent_id="main",
                    role=Role.MAIN,
                    input_ids=np.array(inp),
                    output_ids=np.array(t.output, np.int64),
                    output_logprobs=np.array(t.logprobs, np.float64),
                    weight_version=e.version,
                )
            )
        recs.append(Score(execution_id=f"e{k}", group_id=f"g{e.group}", value=e.reward))
    return recs


def slime_rows(execs: list[Execution]) -> list[str]:
    rows = []
    for k, e in enumerate(execs):
        ids, mask, lps = _response(e)
        version = "default" if e.version == 0 else str(e.version)
        rows.append(
            {
                "group_index": e.group,
                "index": k,
                "rollout_id": None,
                "tokens": e.prompt + ids,
                "response_length": len(ids),
                "loss_mask": mask,
                "rollout_log_probs": lps,
                "weight_versions": [version] * max(1, len(e.turns)),
                "reward": e.reward,
                "status": "completed",
            }
        )
    return [json.dumps(r) for r in rows]


def verl_rows(execs: list[Execution]) -> list[str]:
    rows = []
    for e in execs:
        ids, mask, lps = _response(e)
        rows.append(
            {
                "input": "(text)",
                "output": "(text)",
                "gts": None,
                "score": e.reward,
                "step": 0,
                "uid": f"u{e.group}",
                "prompt_ids": e.prompt,
                "response_ids": ids,
                "response_mask": mask,
                "response_logprobs": lps,
                "weight_version": e.version,
            }
        )
    return [json.dumps(r) for r in rows]


def vllm_log(execs: list[Execution]) -> list[str]:
    lines = []
    for k, e in enumerate(execs):
        turns = e.turns or [Turn([], [], [])]
        for j, (inp, t) in enumerate(zip(_inputs(e), turns, strict=True)):
            content = [
                {"token": f"token_id:{i}", "logprob": lp, "bytes": [], "top_logprobs": []}
                for i, lp in zip(t.output, t.logprobs, strict=True)
            ]
            response = {
                "id": f"chatcmpl-{k}-{j}",
                "object": "chat.completion",
                "model": "m",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": ""},
                        "logprobs": {"content": content},
                        "finish_reason": "stop",
                        "token_ids": t.output,
                    }
                ],
                "prompt_token_ids": inp,
            }
            last = j == len(turns) - 1
            lines.append(
                {
                    "session_id": f"s{k}",
                    "group_id": f"q{e.group}",
                    "weight_version": e.version,
                    "reward": e.reward if last else None,
                    "response": response,
                }
            )
    return [json.dumps(x) for x in lines]


def signature(forest: Forest) -> list[Any]:
    """What a forest trains on, execution by execution in order, with ids and names left out: tokens
    and tree structure, policy tokens with their logprobs and versions, each call's input and output,
    the score and its group (as the index of the group's first execution)."""
    groups: dict[str, int] = {}
    out = []
    for tree in forest:
        assert tree.score is not None
        policy = tree.policy
        out.append(
            (
                tree.ids.tolist(),
                tree.parent.tolist(),
                policy.tolist(),
                tree.logprob[policy].tolist(),
                tree.version[policy].tolist(),
                [[seq.tolist() for seq in tree.call_sequence(cid)] for cid in tree.order],
                tree.score.value,
                groups.setdefault(tree.score.group_id, len(groups)),
            )
        )
    return out


settings_ = settings(
    max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


@settings_
@given(executions())
def test_every_layout_reads_to_the_forest_of_gyres_own_records_150_cases(execs: list[Execution]) -> None:
    want = signature(Forest().add_all(gyre_records(execs)))
    assert signature(Forest().add_all(iter_slime(slime_rows(execs), "samples.jsonl"))) == want
    assert signature(Forest().add_all(iter_verl(verl_rows(execs), "0.jsonl"))) == want
    assert signature(Forest().add_all(iter_messages(vllm_log(execs), "calls.jsonl"))) == want


@settings(
    max_examples=30,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(executions())
def test_a_dump_written_as_gyre_records_reads_back_the_same_30_cases(
    tmp_path: Path, execs: list[Execution]
) -> None:
    recs = list(iter_slime(slime_rows(execs), "samples.jsonl"))
    want = signature(Forest().add_all(recs))
    for name, batch in (("r.jsonl", None), ("r.msgpack", None), ("b.msgpack", 2)):
        write_records(tmp_path / name, recs, batch=batch)
        assert signature(Forest().add_all(read_records(tmp_path / name))) == want
