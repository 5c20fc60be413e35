"""The simulator: configs load strictly, invariants hold, each policy means what policy.py says, and the
presets meet their acceptance: 2p4t near the report's ratios, tb122b losing more to Colocate."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gyre_sched.cli import main
from gyre_sched.policy import POLICY_NAMES
from gyre_sched.protocol import Role
from gyre_sched.sim import Simulator, compare, make_policy, run_one
from gyre_sched.workload import (
    ConfigError,
    load_workload,
    query_profile,
    sample_durations,
    workload_from_dict,
)


def test_preset_profile_matches_report() -> None:
    w = load_workload("2p4t")
    over, at_to = query_profile(sample_durations(w), w.timeout_s)
    assert abs(over - 0.611) < 0.05 and abs(at_to - 0.382) < 0.06


def test_bad_configs() -> None:
    with pytest.raises(ConfigError, match="unknown key 'stepz'"):
        workload_from_dict({"run": {"stepz": 3}})
    with pytest.raises(ConfigError, match="must be int"):
        workload_from_dict({"run": {"steps": "3"}})
    with pytest.raises(ConfigError, match="unknown section"):
        workload_from_dict({"runn": {}})
    with pytest.raises(ConfigError, match="no file or preset"):
        load_workload("nope")


SMALL = {
    "run": {"steps": 6, "timeout_h": 2.0},
    "batch": {"queries": 4, "group_size": 2},
    "durations": {"median_h": 0.5, "sigma": 0.8},
    "cell": {"train_group_s": 120.0},
}


def test_small_run_all_policies(tmp_path: Path) -> None:
    cfg = tmp_path / "w.json"
    cfg.write_text(json.dumps(SMALL))
    w = load_workload(cfg)
    for policy in POLICY_NAMES:
        for streaming in (True, False):
            r = run_one(w, policy, streaming=streaming)
            assert r.end_to_end_h > 0 and 0 <= r.idle_total <= 1
            assert r.timeouts <= 6 * 4 * 2
    rs = run_one(w, "elastic")
    assert all(d.why.capacity_after >= d.protects for d in rs.decisions)


def _sim(policy: str, steps: int = 12) -> Simulator:
    w = workload_from_dict({**SMALL, "run": {"steps": steps, "timeout_h": 2.0}})
    sim = Simulator(w, make_policy(policy, w), sample_durations(w))
    sim.run()
    return sim


def test_colocate_starts_nothing_under_a_tail_and_never_splits_the_pool() -> None:
    """The report's Colocate: executions start in cohorts; none starts while an execution of an earlier
    cohort runs; rollout and training never overlap in time. The run-ahead variant does start batches
    under earlier tails, which is the difference between the two names."""
    sim = _sim("colocate")
    starts = sorted({float(t) for t in sim.start_t})
    assert len(starts) < sim.steps  # several batches start together
    for t in starts[1:]:
        earlier = sim.start_t < t
        assert (sim.start_t[earlier] + sim.wall[earlier] <= t + 1e-6).all()
    segs = sim.segments
    for a in segs:
        for b in segs:
            if a.role is Role.ROLLOUT and b.role is Role.TRAINING:
                assert min(a.end_s, b.end_s) - max(a.start_s, b.start_s) <= 1e-6, (a, b)
    ahead = _sim("colocate-runahead")
    overlaps = 0
    for t in sorted({float(x) for x in ahead.start_t})[1:]:
        earlier = ahead.start_t < t
        overlaps += int((ahead.start_t[earlier] + ahead.wall[earlier] > t + 1e-6).any())
    assert overlaps > 0


def test_deterministic_from_a_seed() -> None:
    w = load_workload("tb122b")
    w = replace(w, run=replace(w.run, steps=6))
    a = [r.summary() for r in compare(w, predictive=False)[0]]
    b = [r.summary() for r in compare(w, predictive=False)[0]]
    assert a == b


def test_tb122b_profile_is_the_reports() -> None:
    """9.51% of the 122B runs' queries ran over 4 h: the preset's expected share over 40 seeds."""
    w = load_workload("tb122b")
    assert (w.run.steps, w.driver.staleness_target) == (24, 1.5)
    shares = [query_profile(sample_durations(w, np.random.default_rng(s)), w.timeout_s)[0] for s in range(40)]
    assert abs(float(np.mean(shares)) - 0.0951) < 0.005


def _simulate_compare(preset: str, capsys: pytest.CaptureFixture[str], seed: int = 0) -> dict[str, Any]:
    """`gyre-sched simulate PRESET --policy compare`: its last line is the JSON summary."""
    assert main(["simulate", preset, "--policy", "compare", "--seed", str(seed)]) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    return out


@pytest.mark.slow
def test_2p4t_lands_within_15_percent_of_the_reports_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    out = _simulate_compare("2p4t", capsys)
    assert abs(out["speedup_vs_async"] / 1.78 - 1) <= 0.15
    assert abs(out["speedup_vs_colocate"] / 1.21 - 1) <= 0.15
    for r in out["results"]:
        assert r["staleness_mean"] <= 1.5 + 0.05, r  # every policy under the same target


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 2])
def test_tb122b_loses_more_to_colocate_than_to_async(capsys: pytest.CaptureFixture[str], seed: int) -> None:
    out = _simulate_compare("tb122b", capsys, seed)
    assert out["speedup_vs_colocate"] > out["speedup_vs_async"] > 1.0
    for r in out["results"]:
        assert r["staleness_mean"] <= 1.5 + 0.05, r


def test_cli_simulate_writes_plot_and_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "w.toml"
    cfg.write_text(
        "[run]\nsteps = 4\ntimeout_h = 1.0\n[batch]\nqueries = 4\ngroup_size = 2\n[durations]\nmedian_h = 0.3\n"
    )
    png, log = tmp_path / "t.png", tmp_path / "d.jsonl"
    assert main(["simulate", str(cfg), "--plot", str(png), "--log", str(log)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {r["policy"] for r in last["results"]} == set(POLICY_NAMES)
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert lines and all("why" in x and "rule" in x for x in lines)
    assert main(["simulate", str(tmp_path / "missing.toml")]) == 2


def test_an_execution_cut_by_the_timeout_keeps_its_slot_for_its_overrun() -> None:
    """`overrun`: a harness that waits for the model call in flight when the timeout strikes holds the
    execution's slot past it; the execution counts as timed out, also when its work ends in the overrun,
    and the batch (so the step trained on it) ends that much later."""
    w = workload_from_dict(
        {**SMALL, "run": {"steps": 1, "timeout_h": 1.0}, "batch": {"queries": 1, "group_size": 3}}
    )
    t = w.timeout_s
    d = np.array([[[10 * t, t + 100.0, 0.5 * t]]])  # far past the timeout, just past it, within it

    def sim(overrun: np.ndarray | None) -> Simulator:
        s = Simulator(w, make_policy("elastic", w), d, overrun=overrun)
        s.run()
        return s

    cut = sim(None)
    np.testing.assert_allclose(cut.wall, [t, t, 0.5 * t])
    assert cut.timed_out.tolist() == [True, True, False]
    held = sim(np.array([[[600.0, 600.0, 600.0]]]))
    np.testing.assert_allclose(held.wall, [t + 600.0, t + 100.0, 0.5 * t])  # the second's work ends first
    assert held.timed_out.tolist() == [True, True, False]
    assert held.t == pytest.approx(cut.t + 600.0)
    assert run_one(w, "elastic", durations=d, overrun=np.zeros(d.shape)).end_to_end_h * 3600 == cut.t
    for bad in (np.zeros((1, 1, 2)), np.full(d.shape, -1.0)):
        with pytest.raises(ValueError, match="overrun"):
            Simulator(w, make_policy("elastic", w), d, overrun=bad)


def test_training_cells_train_at_the_measured_cost_for_their_count(tmp_path: Path) -> None:
    """`cell.train_group_s_by_cells`: cells that share a GPU do not train twice as fast side by side. With
    two cells costing twice the cell-seconds a group, Colocate's whole-pool training takes as long as one
    cell's, and its run is longer; Async, whose one cell trains alone, is unchanged. The list loads from
    a workload file, and a count past its end takes its last item."""
    run = {"steps": 4, "cells": 2, "timeout_h": 2.0}
    flat = workload_from_dict({**SMALL, "run": run, "cell": {"train_group_s": 120.0, "update_s": 0.0}})
    path = tmp_path / "w.toml"
    path.write_text(
        "[run]\nsteps = 4\ncells = 2\ntimeout_h = 2.0\n[batch]\nqueries = 4\ngroup_size = 2\n"
        "[durations]\nmedian_h = 0.5\nsigma = 0.8\n"
        "[cell]\ntrain_group_s = 120.0\nupdate_s = 0.0\ntrain_group_s_by_cells = [120, 240.0]\n"
    )
    shared = load_workload(path)
    assert shared.cell.train_group_s_by_cells == (120.0, 240.0)
    assert [shared.cell.group_s(k) for k in (1, 2, 3)] == [120.0, 240.0, 240.0]
    assert [flat.cell.group_s(k) for k in (1, 2)] == [120.0, 120.0]

    def training_s(w: Any, policy: str) -> tuple[float, float]:
        s = Simulator(w, make_policy(policy, w), sample_durations(flat))
        r = s.run()
        training = [g.end_s - g.start_s for g in r.timeline if g.role is Role.TRAINING]
        return r.end_to_end_h * 3600.0, sum(training)

    assert training_s(shared, "async") == training_s(flat, "async")
    (e_flat, t_flat), (e_shared, t_shared) = training_s(flat, "colocate"), training_s(shared, "colocate")
    assert e_shared > e_flat
    # both cells in every training phase: the phases last twice as long
    assert t_shared == pytest.approx(2 * t_flat)
    with pytest.raises(ConfigError, match="train_group_s_by_cells"):
        workload_from_dict({"cell": {"train_group_s_by_cells": [1.0, 0.0]}})
    with pytest.raises(ConfigError, match=r"train_group_s_by_cells\[0\] must be float"):
        workload_from_dict({"cell": {"train_group_s_by_cells": ["x"]}})


def test_groups_train_in_the_work_their_executions_brought() -> None:
    """`work`: with each execution worth 1 / group_size of a group, and none cut by the timeout, the run is
    the one without it; twice the work, training phases twice as long; an execution cut by the timeout
    brings the share of its work its progress reached."""
    run = {"steps": 3, "cells": 2, "timeout_h": 100.0}
    w = workload_from_dict({**SMALL, "run": run, "cell": {"train_group_s": 120.0, "update_s": 0.0}})
    d = sample_durations(w)
    G = w.batch.group_size

    def sim(policy: str, work: np.ndarray | None, durations: np.ndarray = d) -> Simulator:
        s = Simulator(w, make_policy(policy, w), durations, work=work)
        s.run()
        return s

    def training_s(s: Simulator) -> float:
        return sum(g.end_s - g.start_s for g in s.segments if g.role is Role.TRAINING)

    for policy in ("elastic", "colocate", "async"):
        plain, unit = sim(policy, None), sim(policy, np.full(d.shape, 1.0 / G))
        assert unit.t == pytest.approx(plain.t) and unit.timed_out.sum() == 0
    unit, double = sim("colocate", np.full(d.shape, 1.0 / G)), sim("colocate", np.full(d.shape, 2.0 / G))
    assert training_s(double) == pytest.approx(2 * training_s(unit))
    assert double.t > unit.t

    # One step of one group of two, on one cell: an execution cut at half its duration brings half its work.
    one = workload_from_dict(
        {"run": {"steps": 1, "cells": 1, "timeout_h": 1.0}, "batch": {"queries": 1, "group_size": 2},
         "durations": {"median_h": 0.2}, "cell": {"train_group_s": 100.0, "update_s": 0.0,
                                                   "to_training_s": 0.0}},
    )  # fmt: skip
    t = one.timeout_s
    cut = Simulator(
        one, make_policy("colocate", one), np.array([[[2 * t, 0.5 * t]]]), work=np.array([[[1.0, 1.0]]])
    )
    cut.run()
    assert cut.timed_out.tolist() == [True, False]
    assert cut.ready_work[0] == pytest.approx(1.5)  # half of the first, all of the second
    assert cut.t == pytest.approx(t + 150.0)  # the batch ends at the timeout, then 1.5 x 100 s of training
    for bad in (np.zeros((1, 1, 3)), np.full((1, 1, 2), -1.0), np.full((1, 1, 2), np.nan)):
        with pytest.raises(ValueError, match="work"):
            Simulator(one, make_policy("colocate", one), np.array([[[1.0, 1.0]]]), work=bad)
