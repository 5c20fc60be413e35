from __future__ import annotations

import numpy as np
import pytest
from gyre_traj.records import RecordError, Role
from gyre_traj.tree import ExecutionTree, Forest

from .helpers import OUT, SYS, TOOL, USER, call, ids

PROMPT = ids(SYS, 1, 2, 3) + ids(USER, 1, 2)


def build(*calls: object) -> ExecutionTree:
    t = ExecutionTree("e")
    for c in calls:
        t.add(c)  # type: ignore[arg-type]
    return t


def test_linear_conversation_is_one_chain() -> None:
    a1 = ids(OUT, 1, 2)
    t = build(
        call("c0", PROMPT, a1),
        call("c1", PROMPT + a1 + ids(TOOL, 1), ids(OUT, 3)),
        call("c2", None, ids(OUT, 4), delta=("c1", 9, ids(TOOL, 2))),
    )
    assert t.n == 5 + 2 + 1 + 1 + 1 + 1
    assert [leaf.call_id for leaf in t.leaves()] == ["c2"]
    assert t.policy_tokens == 4
    inp, out = t.call_sequence("c1")
    assert inp.tolist() == PROMPT + a1 + ids(TOOL, 1) and out.tolist() == ids(OUT, 3)


def test_policy_token_stays_policy_when_carried_as_context() -> None:
    a1 = ids(OUT, 1, 2)
    t = build(call("c0", PROMPT, a1, version=4), call("c1", PROMPT + a1 + ids(TOOL, 1), ids(OUT, 3)))
    seq = t.sequence(t.calls["c1"].end)
    nodes = t.path_nodes(t.calls["c1"].end)
    assert seq[5:7].tolist() == a1
    assert t.policy[nodes[5:7]].all() and (t.version[nodes[5:7]] == 4).all()
    assert np.allclose(t.logprob[nodes[5:7]], [-0.1, -0.2])
    assert not t.policy[nodes[7]]  # the tool output is context


def test_retry_branches_at_the_output() -> None:
    t = build(call("c0", PROMPT, ids(OUT, 1, 2)), call("c0-retry", PROMPT, ids(OUT, 7, 8, 9)))
    assert t.n == 5 + 2 + 3
    assert {leaf.call_id for leaf in t.leaves()} == {"c0", "c0-retry"}
    assert t.stats.drifts == []


def test_same_output_twice_is_stored_and_trained_once() -> None:
    t = build(call("c0", PROMPT, ids(OUT, 1, 2)), call("c0-dup", PROMPT, ids(OUT, 1, 2)))
    assert t.n == 7 and t.stats.output_matched_existing == 2
    assert len(t.leaves()) == 1


def test_context_later_produced_by_policy_is_promoted() -> None:
    t = build(call("c0", PROMPT + ids(OUT, 1), []), call("c1", PROMPT, ids(OUT, 1, 2)))
    assert t.stats.context_promoted == 1 and t.policy_tokens == 2


def test_compaction_and_subagent_branch_from_the_system_prompt() -> None:
    a1 = ids(OUT, 1, 2)
    summary_req = ids(USER, 9)
    t = build(
        call("c0", PROMPT, a1),
        call("s0", None, ids(OUT, 50), delta=("c0", 7, summary_req), role=Role.MAIN_SUMMARY),
        call("c1", None, ids(OUT, 60), delta=("s0", 3, ids(USER, 8) + ids(OUT, 50))),
        call("sub0", ids(SYS, 1, 2, 3) + ids(USER, 5), ids(OUT, 70), role=Role.SUBAGENT, agent="sub0"),
    )
    roles = sorted(leaf.role.value for leaf in t.leaves())
    assert roles == ["main", "main_summary", "subagent"]
    # The summary is policy where it was produced and context where the restarted main agent reads it.
    c1_nodes = t.path_nodes(t.calls["c1"].end)
    assert t.ids[c1_nodes[4]] == OUT + 50 and not t.policy[c1_nodes[4]]
    assert t.stats.drifts == []


def test_drift_is_counted_and_becomes_a_branch() -> None:
    a1 = ids(OUT, 1, 2, 3)
    retok = ids(OUT, 1, 9, 3)  # the harness re-tokenized the assistant turn
    t = build(call("c0", PROMPT, a1), call("c1", PROMPT + retok + ids(TOOL, 1), ids(OUT, 4)))
    (d,) = t.stats.drifts
    assert d.call_id == "c1" and d.position == 6 and d.expected == (OUT + 2,) and d.got == OUT + 9
    # The drifted copy is context on its own branch; the original policy tokens are untouched.
    assert t.policy_tokens == 4
    inp, _ = t.call_sequence("c1")
    assert inp.tolist() == PROMPT + retok + ids(TOOL, 1)


def test_delta_errors_name_the_record() -> None:
    t = build(call("c0", PROMPT, ids(OUT, 1)))
    with pytest.raises(RecordError, match=r"call='c9'.*unknown parent call 'nope'"):
        t.add(call("c9", None, [], delta=("nope", 1, [])))
    with pytest.raises(RecordError, match=r"keep=99 exceeds parent 'c0' length 6"):
        t.add(call("c9", None, [], delta=("c0", 99, [])))
    with pytest.raises(RecordError, match="duplicate call id"):
        t.add(call("c0", PROMPT, []))
    with pytest.raises(RecordError, match="belongs to execution"):
        t.add(call("x", PROMPT, [], execution="other"))


def test_forest_attaches_scores_in_any_order() -> None:
    from gyre_traj.records import Score

    f = Forest()
    f.add(Score(execution_id="e", group_id="g", value=1.0))
    f.add(call("c0", PROMPT, ids(OUT, 1)))
    f.add(call("c0", PROMPT, ids(OUT, 1), execution="e2"))
    f.add(Score(execution_id="e2", group_id="g", value=0.0))
    assert len(f) == 2 and f.trees["e"].score is not None and f.trees["e2"].score is not None


def test_empty_call_and_growth_past_capacity() -> None:
    t = ExecutionTree("e", capacity=4)
    t.add(call("c0", [], []))
    t.add(call("c1", list(range(1000, 1100)), list(range(4000, 4100))))
    assert t.n == 200 and t.calls["c0"].end == -1
    assert t.call_sequence("c1")[1].tolist() == list(range(4000, 4100))


def test_negative_ids_rejected_on_the_fast_msgpack_path() -> None:
    from gyre_traj.io import encode_msgpack_stream
    from gyre_traj.records import Call

    good = call("c0", PROMPT, ids(OUT, 1))
    with pytest.raises(RecordError, match="negative id -5"):
        call("c1", [*PROMPT, -5], [])
    # Build a record with a negative input id behind the constructor's back, as a corrupt file would.
    import msgspec

    bad = msgspec.structs.replace(good, call_id="c1")
    msgspec.structs.force_setattr(bad, "input_ids", np.array([*PROMPT, 4001, -5], np.int32))
    data = encode_msgpack_stream([good, bad])
    with pytest.raises(RecordError, match=r"call='c1'.*negative id -5 at position 6"):
        Forest().add_msgpack(data)
    assert isinstance(bad, Call)


def test_growth_keeps_views_held_by_callers_valid() -> None:
    t = ExecutionTree("e", capacity=4)
    t.add(call("c0", PROMPT, ids(OUT, 1)))
    held = t.ids[:3]  # a caller's view into the arena
    before = held.copy()
    t.add(call("c1", list(range(1000, 1500)), []))  # forces growth
    assert np.array_equal(held, before) and t.ids[:3].tolist() == before.tolist()
    assert t.call_sequence("c1")[0].tolist() == list(range(1000, 1500))


def test_delta_cut_before_the_parent_output_is_not_drift() -> None:
    """Found by the state machine: a delta call whose kept prefix ends before its parent's output, then
    follows another branch; the parent's output position is not on this call's path, so no drift."""
    t = build(
        call("c0", PROMPT[:3] + ids(USER, 8) + ids(OUT, 0) + ids(TOOL, 0), []),
        call("c1", PROMPT[:3] + ids(USER, 9), ids(OUT, 0, 0), role=Role.MAIN_SUMMARY),
        call("c2", None, [], delta=("c1", 3, ids(USER, 8) + ids(OUT, 0, 0) + ids(TOOL, 0))),
    )
    assert t.stats.drifts == []
    assert t.call_sequence("c2")[0].tolist() == PROMPT[:3] + ids(USER, 8) + ids(OUT, 0, 0) + ids(TOOL, 0)
