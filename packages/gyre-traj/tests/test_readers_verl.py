"""verl's rollout dumps (`trainer.rollout_data_dir`: `<step>.jsonl` per step, rows of `input`, `output`,
`gts`, `score`, `step` and the reward function's extra fields, as `fixtures/make_fixtures.py` writes
them): read with the agent loop's token fields, refused without them, naming what would supply them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gyre_traj.cli import main
from gyre_traj.io import read_records, sniff_format
from gyre_traj.readers import iter_verl
from gyre_traj.records import Call, RecordError, Score
from gyre_traj.tree import Forest

FIXTURES = Path(__file__).parent / "fixtures" / "verl"
DUMP = FIXTURES / "with_ids"


def _rows(step: int = 1) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (DUMP / f"{step}.jsonl").read_text().splitlines()]


def _read(rows: list[dict[str, Any]]) -> list[Call | Score]:
    return list(iter_verl([json.dumps(r) for r in rows], "1.jsonl"))


def test_a_dump_directory_reads_in_step_order() -> None:
    assert sniff_format(DUMP) == "verl"
    recs = list(read_records(DUMP))
    scores = [r for r in recs if isinstance(r, Score)]
    # execution <step>-<row of the step>; group: the step and verl's uid; scores as verl wrote them
    assert [(s.execution_id, s.group_id, s.value) for s in scores] == [
        ("1-0", "1-u-0", 1.0),
        ("1-1", "1-u-0", 0.0),
        ("1-2", "1-u-1", 3.0),
        ("1-3", "1-u-1", -1.0),
        ("2-0", "2-u-2", 1.0),
        ("2-1", "2-u-2", 0.0),
    ]


def test_a_multi_turn_row_splits_at_the_response_mask() -> None:
    row = _rows()[0]
    first, second, score = _read([row])
    assert isinstance(first, Call) and isinstance(second, Call) and isinstance(score, Score)
    mask = np.array(row["response_mask"])
    end = int(np.flatnonzero(np.diff(mask) == -1)[0]) + 1
    start2 = int(np.flatnonzero(np.diff(mask) == 1)[0]) + 1
    resp = row["response_ids"]
    assert first.input_ids is not None and first.input_ids.tolist() == row["prompt_ids"]
    assert first.output_ids.tolist() == resp[:end]
    assert second.input_delta is not None and second.input_delta.append.tolist() == resp[end:start2]
    assert second.output_ids.tolist() == resp[start2:]
    np.testing.assert_allclose(
        second.output_logprobs, np.array(row["response_logprobs"][start2:], np.float32)
    )
    forest = Forest().add_all([first, second, score])
    (tree,) = forest
    assert tree.policy_tokens == int(mask.sum())  # the tool response's tokens are context


def test_a_row_ending_in_a_tool_response_leaves_it_out() -> None:
    row = _rows()[3]  # the model's turn, then a tool response the policy never answered
    (call, _score) = _read([row])
    assert isinstance(call, Call) and call.input_ids is not None
    assert (
        call.input_ids.tolist() + call.output_ids.tolist()
        == row["prompt_ids"] + row["response_ids"][: int(sum(row["response_mask"]))]
    )


def test_rows_without_uid_group_by_prompt_ids() -> None:
    rows = _rows()
    for r in rows:
        del r["uid"]
    groups = [r.group_id for r in _read(rows) if isinstance(r, Score)]
    assert groups[0] == groups[1] != groups[2] == groups[3]


def test_the_stock_text_only_dump_is_refused_naming_the_missing_fields() -> None:
    path = FIXTURES / "text_only"
    assert sniff_format(path) == "verl"
    with pytest.raises(RecordError) as err:
        list(read_records(path))
    msg = str(err.value)
    assert msg.startswith(f"{path / '1.jsonl'}:1: no token ids: `prompt_ids`, `response_ids` missing")
    assert "the row has only text: `input`, `output`" in msg
    assert (
        "skip_special_tokens=True" in msg and "calculate_log_probs=True" in msg and "`response_mask`" in msg
    )


def test_inspect_and_pack_a_dump(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(DUMP)]) == 0
    out = capsys.readouterr().out
    assert "score: 3.000" in out and "score: -1.000" in out and "unscored" not in out
    assert main(["pack", str(DUMP), "--out", str(tmp_path / "packed")]) == 0
    manifest = json.loads((tmp_path / "packed" / "manifest.json").read_text())
    assert manifest["executions"] == 6 and manifest["unscored_skipped"] == 0
    assert main(["inspect", str(FIXTURES / "text_only")]) == 2
    assert "no token ids" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r.pop("response_logprobs"), r":1: no behaviour logprobs \(`response_logprobs`"),
        (
            lambda r: r.update(response_mask=[1]),
            r"`response_mask` must be a list of \d+ zeros and ones, got 1 entries",
        ),
        (
            lambda r: r.update(response_logprobs=r["response_logprobs"][:-1]),
            r"`response_logprobs` for \d+ `response_ids`",
        ),
        (lambda r: r.update(score=float("nan")), r":1: `score` is nan: a reward must be a finite number"),
        (lambda r: r.update(score="1.0"), r":1: `score` must be a number, got '1.0'"),
        (lambda r: r.update(response_ids="abc"), r"`response_ids` must be a list of token ids"),
        (lambda r: r.update(prompt_ids=[1.5]), r"`prompt_ids` must be integers"),
    ],
)
def test_bad_rows_are_refused_naming_the_field(change: Any, message: str) -> None:
    rows = _rows()[:1]
    change(rows[0])
    with pytest.raises(RecordError, match=message):
        _read(rows)


def test_logprobs_under_the_batch_name_and_a_null_score() -> None:
    row = _rows()[1]
    row["rollout_log_probs"] = row.pop("response_logprobs")
    row["score"] = None
    recs = _read([row])
    assert [type(r).__name__ for r in recs] == ["Call"]  # read, unscored
