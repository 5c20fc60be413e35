"""slime's rollout samples (`Sample.to_dict()` rows, as `fixtures/make_fixtures.py` writes them from
slime's field list): calls split at the loss mask, tool output as context, rewards on any finite scale,
compacted rollouts as one execution, and an error naming the row and the field for what is wrong."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gyre_traj.io import read_records, sniff_format, write_records
from gyre_traj.readers import iter_slime
from gyre_traj.records import Call, RecordError, Score
from gyre_traj.tree import Forest

FIXTURES = Path(__file__).parent / "fixtures"
SAMPLES = FIXTURES / "slime" / "samples.jsonl"


def _rows() -> list[dict[str, Any]]:
    return [json.loads(line) for line in SAMPLES.read_text().splitlines()]


def _read(rows: list[dict[str, Any]], **kw: Any) -> list[Call | Score]:
    return list(iter_slime([json.dumps(r) for r in rows], "samples.jsonl", **kw))


def test_samples_become_calls_split_at_the_loss_mask() -> None:
    assert sniff_format(SAMPLES) == "slime"
    recs = list(read_records(SAMPLES))
    calls = [r for r in recs if isinstance(r, Call)]
    row = _rows()[0]
    tokens, n_resp, mask, lps = (
        row[k] for k in ("tokens", "response_length", "loss_mask", "rollout_log_probs")
    )
    response = np.array(tokens[len(tokens) - n_resp :])
    first, second = (c for c in calls if c.execution_id == "0")
    # the first turn: the prompt in full, the model's reply as output with its logprobs
    run = np.flatnonzero(mask)
    end = int(np.flatnonzero(np.diff(mask) == -1)[0]) + 1
    assert first.input_ids is not None and first.input_ids.tolist() == tokens[: len(tokens) - n_resp]
    assert first.output_ids.tolist() == response[:end].tolist()
    np.testing.assert_allclose(first.output_logprobs, np.array(lps[:end], np.float32))
    # the second turn: a delta that keeps the first call and appends the tool result (loss_mask 0)
    start2 = int(run[run >= end][0])
    assert second.input_delta is not None
    assert second.input_delta.parent == first.call_id
    assert second.input_delta.keep == len(tokens) - n_resp + end
    assert second.input_delta.append.tolist() == response[end:start2].tolist()
    assert second.output_ids.tolist() == response[start2:].tolist()
    assert (first.weight_version, second.weight_version) == (3, 3)
    assert [c.finish_reason for c in calls if c.execution_id == "2"] == ["length"]  # status truncated


def test_rewards_on_any_scale_and_groups() -> None:
    recs = list(read_records(SAMPLES))
    scores = {r.execution_id: (r.group_id, r.value) for r in recs if isinstance(r, Score)}
    # -0.5 and 2.5 are rewards like any other; rollout 7 (samples 4 and 5) is scored once
    assert scores == {
        "0": ("0", 1.0),
        "1": ("0", 0.0),
        "2": ("0", -0.5),
        "3": ("0", 2.5),
        "7": ("1", 1.0),
        "8": ("1", 0.0),
    }
    forest = Forest().add_all(recs)
    assert {t.execution_id for t in forest} == set(scores)
    assert all(t.score is not None for t in forest)  # not "6 unscored"


def test_tool_output_is_context_and_versions_follow_the_turns() -> None:
    forest = Forest().add_all(read_records(SAMPLES))
    tree = forest.trees["1"]
    row = _rows()[1]
    n_prompt = len(row["tokens"]) - row["response_length"]
    (leaf,) = tree.leaves()
    path = tree.path_nodes(leaf.end)
    assert tree.ids[path].tolist() == row["tokens"]  # the whole sample is one path
    assert tree.policy[path][n_prompt:].tolist() == [bool(m) for m in row["loss_mask"]]
    assert not tree.policy[path][:n_prompt].any()
    assert sorted(set(tree.version[path][n_prompt:][tree.policy[path][n_prompt:]].tolist())) == [3, 4]
    assert forest.trees["3"].version[forest.trees["3"].policy].tolist() == [0] * 6  # "default": never updated


def test_a_compacted_rollout_is_one_execution() -> None:
    forest = Forest().add_all(read_records(SAMPLES))
    tree = forest.trees["7"]
    assert sorted(tree.calls) == ["sample4.turn-0", "sample5.turn-0", "sample5.turn-1"]
    assert len(tree.leaves()) == 2  # the two samples branch after their shared prompt


def test_round_trip_through_gyre_records(tmp_path: Path) -> None:
    recs = list(read_records(SAMPLES))
    for fmt in ("jsonl", "msgpack"):
        path = tmp_path / f"r.{fmt}"
        write_records(path, recs, batch=3 if fmt == "msgpack" else None)
        back = Forest().add_all(read_records(path))
        ref = Forest().add_all(recs)
        for tree in ref:
            other = back.trees[tree.execution_id]
            assert other.score == tree.score
            for cid in tree.calls:
                got, want = other.call_sequence(cid), tree.call_sequence(cid)
                assert [g.tolist() for g in got] == [w.tolist() for w in want]
            assert other.logprob[other.policy].tolist() == tree.logprob[tree.policy].tolist()


def test_a_dict_reward_needs_its_key() -> None:
    rows = _rows()[:2]
    rows[0]["reward"] = {"score": 1.0, "format": 0.5}
    rows[1]["reward"] = {"score": -1.0, "format": 1.0}
    with pytest.raises(
        RecordError, match=r"samples\.jsonl:1: `reward` is a dict .*'format', 'score'.*reward_key"
    ):
        _read(rows)
    scores = [r.value for r in _read(rows, reward_key="format") if isinstance(r, Score)]
    assert scores == [0.5, 1.0]
    with pytest.raises(RecordError, match=r"samples\.jsonl:1: `reward` has no key 'acc'"):
        _read(rows, reward_key="acc")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_reward_is_refused_naming_the_row_and_field(tmp_path: Path, value: float) -> None:
    rows = _rows()
    rows[2]["reward"] = value
    path = tmp_path / "samples.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))  # json.dumps writes NaN / Infinity
    with pytest.raises(
        RecordError, match=rf"samples\.jsonl:3: `reward` is {value}: a reward must be a finite"
    ):
        list(read_records(path))
    rows[2]["reward"] = True
    with pytest.raises(RecordError, match=r":3: `reward` must be a number, got True"):
        _read(rows)


def test_an_unscored_sample_stays_unscored() -> None:
    rows = _rows()[:1]
    rows[0]["reward"] = None
    assert [type(r).__name__ for r in _read(rows)] == ["Call", "Call"]


def test_compacted_samples_that_disagree_on_the_reward_or_group_are_refused() -> None:
    rows = _rows()
    rows[5]["reward"] = 0.0  # sample 5 of rollout 7, whose sample 4 (line 5) says 1.0
    with pytest.raises(
        RecordError, match=r":6: execution '7' has reward 0.0, but samples\.jsonl:5 gave it 1.0"
    ):
        _read(rows)
    rows = _rows()
    rows[5]["group_index"] = 0
    with pytest.raises(
        RecordError, match=r":6: execution '7' has group '0', but samples\.jsonl:5 gave it '1'"
    ):
        _read(rows)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r.pop("tokens"), r":1: no `tokens` \(the sample's prompt \+ response token ids\)"),
        (lambda r: r.update(rollout_log_probs=None), r":1: no `rollout_log_probs`"),
        (
            lambda r: r.update(rollout_log_probs=r["rollout_log_probs"][1:]),
            r"`rollout_log_probs` for `response_length`",
        ),
        (
            lambda r: r.update(loss_mask=r["loss_mask"][1:]),
            r"`loss_mask` must be a list of \d+ zeros and ones",
        ),
        (
            lambda r: r.update(loss_mask=[2] * r["response_length"]),
            r"`loss_mask` must hold 0 and 1 only, got 2",
        ),
        (lambda r: r.update(response_length=10**6), r"`response_length` must be an integer in \[0, \d+\]"),
        (lambda r: r["tokens"].__setitem__(0, -5), r"`tokens` contain a negative id -5"),
        (
            lambda r: r.update(weight_versions=["v3", "3"]),
            r"`weight_versions\[0\]` must be an integer or a string of digits",
        ),
        (
            lambda r: r.update(rollout_log_probs=[0.5] * r["response_length"]),
            r"`rollout_log_probs` of sampled tokens: logprobs must be <= 0",
        ),
        (lambda r: r.update(multimodal_inputs={"images": ["x.png"]}), r"a multimodal sample"),
    ],
)
def test_bad_samples_are_refused_naming_the_field(change: Any, message: str) -> None:
    rows = _rows()[:1]
    change(rows[0])
    with pytest.raises(RecordError, match=message):
        _read(rows)


def test_a_removed_sample_trains_nothing_but_counts_in_its_group() -> None:
    rows = _rows()[:4]
    rows[1]["remove_sample"] = True
    forest = Forest().add_all(_read(rows))
    assert forest.trees["1"].policy_tokens == 0 and forest.trees["1"].score is not None
    assert forest.trees["0"].policy_tokens > 0


def test_inspect_takes_the_reward_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gyre_traj.cli import main

    rows = _rows()[:4]
    for k, r in enumerate(rows):
        r["reward"] = {"score": float(k), "format": -float(k)}
    path = tmp_path / "samples.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["inspect", str(path), "--json", "--reward-key", "format"]) == 0
    assert [s["score"] for s in json.loads(capsys.readouterr().out)] == [0.0, -1.0, -2.0, -3.0]
    assert main(["inspect", str(path)]) == 2
    assert "`reward` is a dict" in capsys.readouterr().err
