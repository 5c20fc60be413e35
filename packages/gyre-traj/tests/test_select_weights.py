from __future__ import annotations

import pytest
from gyre_traj.records import EvalStatus, Role, Score
from gyre_traj.select import SelectionConfig, select
from gyre_traj.tree import ExecutionTree
from gyre_traj.weights import AdvantageConfig, execution_token_weights, group_advantages

from .helpers import OUT, SYS, USER, call, ids

P = ids(SYS, 1) + ids(USER, 1)


def _tree() -> ExecutionTree:
    t = ExecutionTree("e")
    t.add(call("m-short", P, ids(OUT, 1), t=5.0))
    t.add(call("m-long", P, ids(OUT, 2, 3, 4), t=1.0))
    t.add(call("sum", P + ids(USER, 7), ids(OUT, 9), role=Role.MAIN_SUMMARY, t=0.0))
    t.add(call("sub", ids(SYS, 5), ids(OUT, 5), role=Role.SUBAGENT, agent="s", t=0.0))
    t.add(call("subsum", ids(SYS, 6), ids(OUT, 6), role=Role.SUBAGENT_SUMMARY, agent="s", t=0.0))
    return t


def test_role_priority_then_tie_breaks() -> None:
    t = _tree()
    order = [lf.call_id for lf in select(t, SelectionConfig(j_max=None)).leaves]
    assert order == ["m-long", "m-short", "sum", "sub", "subsum"]
    by_time = [lf.call_id for lf in select(t, SelectionConfig(j_max=2, tie_break=("earliest",))).leaves]
    assert by_time == ["m-long", "m-short"]
    latest = [lf.call_id for lf in select(t, SelectionConfig(j_max=2, tie_break=("latest",))).leaves]
    assert latest == ["m-short", "m-long"]


def test_j_max_and_custom_priority() -> None:
    t = _tree()
    s = select(t, SelectionConfig(j_max=2))
    assert len(s.leaves) == 2 and s.dropped_leaves == 3
    assert s.dropped_policy_tokens == t.policy_tokens - s.loss_nodes.shape[0]
    s2 = select(t, SelectionConfig(j_max=1, priority=(Role.SUBAGENT,)))
    assert [lf.call_id for lf in s2.leaves] == ["sub"]
    with pytest.raises(ValueError, match="j_max"):
        SelectionConfig(j_max=0)
    with pytest.raises(ValueError, match="tie_break"):
        SelectionConfig(tie_break=("random",))  # type: ignore[arg-type]


def test_selection_is_deterministic() -> None:
    a = [lf.call_id for lf in select(_tree()).leaves]
    b = [lf.call_id for lf in select(_tree()).leaves]
    assert a == b


def test_group_advantages_exclude_eval_failures() -> None:
    scores = [
        Score(execution_id="a", group_id="g", value=1.0),
        Score(execution_id="b", group_id="g", value=0.0, timed_out=True),
        Score(execution_id="c", group_id="g", status=EvalStatus.EVAL_FAILED),
        Score(execution_id="d", group_id="h", value=0.5),
    ]
    adv, st = group_advantages(scores)
    assert adv == {"a": 0.5, "b": -0.5}  # c is not a 0; d's group has one valid score
    assert st.eval_failed == 1 and st.failed_executions == ["c"] and st.groups_too_small == 1
    assert st.timed_out_scored == 1
    adv2, _ = group_advantages(scores, AdvantageConfig(std_normalize=True))
    assert adv2["a"] == pytest.approx(1.0, rel=1e-4)
    with pytest.raises(ValueError, match="scored twice"):
        group_advantages(scores + scores[:1])


def test_execution_weights_sum_to_one_over_e() -> None:
    w = execution_token_weights({"x": 10, "y": 1000, "z": 0})
    assert w["x"] * 10 == pytest.approx(0.5) and w["y"] * 1000 == pytest.approx(0.5) and "z" not in w
