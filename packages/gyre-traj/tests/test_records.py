from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from gyre_traj.io import RecordWriter, encode_msgpack_stream, iter_msgpack, read_records, write_records
from gyre_traj.records import Call, EvalStatus, RecordError, Role, Score, as_ids

from .helpers import OUT, SYS, USER, call, ids


def _same(a: Call, b: Call) -> None:
    assert a.call_id == b.call_id and a.role == b.role and a.weight_version == b.weight_version
    assert np.array_equal(a.output_ids, b.output_ids)
    assert np.allclose(a.output_logprobs, b.output_logprobs)
    if a.input_ids is not None:
        assert b.input_ids is not None and np.array_equal(a.input_ids, b.input_ids)
    else:
        assert a.input_delta is not None and b.input_delta is not None
        assert a.input_delta.parent == b.input_delta.parent and a.input_delta.keep == b.input_delta.keep
        assert np.array_equal(a.input_delta.append, b.input_delta.append)


RECS = [
    call("c0", ids(SYS, 1, 2) + ids(USER, 1), ids(OUT, 1, 2)),
    call("c1", None, ids(OUT, 3), delta=("c0", 5, ids(USER, 2)), role=Role.SUBAGENT, version=3),
    call("c2", [], []),
]


@pytest.mark.parametrize("suffix", [".jsonl", ".msgpack"])
def test_round_trip_file(tmp_path: Path, suffix: str) -> None:
    score = Score(execution_id="e", group_id="g", value=0.5, timed_out=True)
    path = tmp_path / f"r{suffix}"
    write_records(path, [*RECS, score])
    back = list(read_records(path))
    assert len(back) == 4
    for a, b in zip(RECS, back[:3], strict=True):
        assert isinstance(b, Call)
        _same(a, b)
    assert back[3] == score
    assert back[0].output_ids.dtype == np.int32  # type: ignore[union-attr]
    assert back[0].output_logprobs.dtype == np.float32  # type: ignore[union-attr]


def test_jsonl_is_readable_json(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    write_records(path, RECS[:1])
    obj = json.loads(path.read_text().splitlines()[0])
    assert obj["kind"] == "call" and obj["input_ids"] == [1001, 1002, 2001] and obj["role"] == "main"


def test_writer_appends_and_fsyncs(tmp_path: Path) -> None:
    path = tmp_path / "log.msgpack"
    with RecordWriter(path, "msgpack", fsync=True) as w:
        w.write(RECS[0])
    with RecordWriter(path, "msgpack") as w:  # reopening appends after the header, no second magic
        w.write(RECS[1])
    assert [r.call_id for r in read_records(path)] == ["c0", "c1"]  # type: ignore[union-attr]


def test_msgpack_arrays_are_zero_copy_views() -> None:
    data = encode_msgpack_stream(RECS[:1])
    (rec,) = iter_msgpack(data)
    assert isinstance(rec, Call) and rec.input_ids is not None
    assert not rec.input_ids.flags.owndata  # a view into the stream, not a copy


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(output_logprobs=np.array([-0.1])), "1 output logprobs for 2 output ids"),
        (dict(output_ids=np.array([4001, -3])), "negative id -3"),
        (
            dict(input_ids=np.array([1, 2]), input_delta=None, output_logprobs=np.array([-0.1, 0.5])),
            "logprobs must be <= 0",
        ),
        (dict(input_ids=None), "exactly one of input_ids / input_delta"),
        (dict(weight_version=-1), "weight_version must be >= 0"),
        (dict(output_ids=np.array([1.5, 2.0])), "must be integers"),
    ],
)
def test_malformed_call_names_the_record(kwargs: dict[str, object], message: str) -> None:
    base: dict[str, object] = dict(
        execution_id="exec-7",
        call_id="call-3",
        agent_id="a",
        role=Role.MAIN,
        input_ids=np.array([1, 2]),
        output_ids=np.array([4001, 4002]),
        output_logprobs=np.array([-0.1, -0.2]),
        weight_version=0,
    )
    base.update(kwargs)
    with pytest.raises(RecordError) as err:
        Call(**base)  # type: ignore[arg-type]
    assert message in str(err.value)
    assert "execution='exec-7'" in str(err.value) and "call='call-3'" in str(err.value)


def test_malformed_line_in_file_names_line_and_record(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    good = json.loads(
        json.dumps(
            {
                "kind": "call",
                "execution_id": "e",
                "call_id": "ok",
                "agent_id": "a",
                "role": "main",
                "input_ids": [1],
                "output_ids": [2],
                "output_logprobs": [-0.5],
                "weight_version": 0,
            }
        )
    )
    bad = dict(good, call_id="broken", output_logprobs=[-0.5, -0.1])
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(RecordError, match=r"bad.jsonl:2.*call='broken'.*2 output logprobs for 1"):
        list(read_records(path))


def test_unknown_role_and_field_rejected(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"kind":"call","execution_id":"e","call_id":"x","agent_id":"a","role":"boss",'
        '"input_ids":[1],"output_ids":[],"output_logprobs":[],"weight_version":0}\n'
    )
    with pytest.raises(RecordError, match=r"bad\.jsonl:1"):
        list(read_records(path))


def test_truncated_msgpack_stream(tmp_path: Path) -> None:
    """A stream cut inside its last frame is a torn tail: an error only when asked to be strict (the
    default leaves it out with a warning: `test_io_torn.py`)."""
    data = encode_msgpack_stream(RECS)
    with pytest.raises(RecordError, match=r"torn tail of \d+ bytes at byte"):
        list(iter_msgpack(data[:-3], tolerate_torn_tail=False))
    with pytest.raises(RecordError, match="bad magic"):
        list(iter_msgpack(b"not a stream"))


def test_scores_validate() -> None:
    # any finite reward is a score (reward functions return any scale); NaN, infinities, a bool or an
    # int beyond float64 are not
    assert [Score(execution_id="e", group_id="g", value=v).value for v in (1.5, -3, 1e300)] == [
        1.5,
        -3.0,
        1e300,
    ]
    for bad in (float("nan"), float("inf"), -float("inf"), True, 10**400, None):
        with pytest.raises(RecordError, match="needs a finite number"):
            Score(execution_id="e", group_id="g", value=bad)
    with pytest.raises(RecordError, match="carries no value"):
        Score(execution_id="e", group_id="g", value=0.0, status=EvalStatus.EVAL_FAILED)
    assert Score(execution_id="e", group_id="g", status=EvalStatus.EVAL_FAILED).value is None


def test_foreign_turns_import(tmp_path: Path) -> None:
    path = tmp_path / "foreign.jsonl"
    lines = [
        {"session_id": "s1", "prompt_ids": [1, 2], "output_ids": [5, 6], "output_logprobs": [-0.1, -0.2]},
        {
            "session_id": "s1",
            "prompt_ids": [1, 2, 5, 6, 3],
            "output_ids": [7],
            "output_token_logprobs": [[-0.3, 7, "x"]],
            "weight_version": 2,
        },
        {"session_id": "s2", "prompt_ids": [9], "output_ids": [8], "rollout_log_probs": [-1.0]},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    recs = list(read_records(path))
    assert [(r.execution_id, r.call_id) for r in recs] == [
        ("s1", "turn-0"),
        ("s1", "turn-1"),
        ("s2", "turn-0"),
    ]  # type: ignore[union-attr]
    second = recs[1]
    assert isinstance(second, Call) and second.weight_version == 2
    assert np.allclose(second.output_logprobs, [-0.3])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt_ids": [1], "output_ids": [2, 3], "logprobs": [-0.1]}) + "\n")
    with pytest.raises(RecordError, match=r"bad.jsonl:1.*1 output logprobs for 2"):
        list(read_records(bad))


@pytest.mark.parametrize("values", [[1e300], [float("inf")], [float("nan")], [3.0, -1e19]])
def test_float_ids_beyond_int32_or_not_finite_are_refused_without_a_numpy_warning(
    values: list[float],
) -> None:
    # found by the JSON Lines reader's fuzz test: a huge integral float was cast to int64 first, and
    # numpy's "invalid value encountered in cast" escaped as a RuntimeWarning instead of a RecordError
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match=r"int32 range|must be integers"):
            as_ids(values)


def test_a_row_of_no_known_layout_is_refused_listing_its_keys(tmp_path: Path) -> None:
    path = tmp_path / "what.jsonl"
    path.write_text(json.dumps({"prompt": "hi", "completion": "there"}) + "\n")
    with pytest.raises(
        RecordError,
        match=r"what\.jsonl: cannot tell the format from the first row's keys \(completion, prompt\)",
    ):
        list(read_records(path))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert list(read_records(empty)) == []
