"""The floors of the H200 run's switches and pushes, and the run's figures set against them, worked by hand."""

from __future__ import annotations

from pathlib import Path

import pytest
from gyre.measure import floors


def test_floors_from_bytes_and_bandwidths() -> None:
    bw = {"d2h_pinned_gbps": 50.0, "h2d_pinned_gbps": 40.0, "memcpy_gbps": 20.0}
    f = floors.floors(2e9, bw)
    assert f["floor_to_training_s"] == pytest.approx(2 / 50)  # weights out to the host
    assert f["push_floor_s"] == pytest.approx(2 / 50 + 2 / 20 + 2 / 40)  # publish, pull, copy in
    assert f["floor_to_rollout_s"] == pytest.approx(2 / 40 + f["push_floor_s"])  # resume, then the push
    assert floors.floors(2e9, bw, graph_recapture_s=0.5)["floor_to_rollout_s"] == pytest.approx(
        f["floor_to_rollout_s"] + 0.5
    )


def test_measured_copies_on_the_cpu_are_positive() -> None:
    got = floors.measure_copies("cpu", 1 << 20, repeats=1)
    assert got["bytes"] == 1 << 20 and all(v > 0 for k, v in got.items() if k.endswith("gbps"))


def test_run_figures_and_goals() -> None:
    metrics = {
        "steps_applied": 2,
        "end_to_end_s": 25.0,
        "switch_times": {"to_training_s": [0.4, 0.6, 2.0], "to_rollout_s": [1.0, 3.0]},
        "roles": {"cell_seconds": {"rollout_busy_s": 10.0}, "idle_rollout": 0.2},
        "steps": [
            {"version": 1, "push_s": 0.3, "busy_cell_s": 2.0, "tokens": 400, "mean_score": 0.5, "loss": 0.1},
            {
                "version": 2,
                "push_s": None,
                "busy_cell_s": 2.0,
                "tokens": 600,
                "mean_score": 0.75,
                "loss": 0.2,
            },
            {"version": 2, "skipped": True, "tokens": 0},
        ],
        "moves": {"kv_migrations": 2, "moved_calls": 3},
    }
    r = floors.run_figures(metrics, output_tokens=5000)
    assert r["switch_to_training_s"] == 0.6 and r["switch_to_rollout_s"] == 2.0
    assert r["push_s"] == {"1": 0.3, "2": None}
    assert r["rollout_tok_s_in_run"] == 500.0 and r["train_tok_s_in_run"] == 250.0
    assert r["rollout_tok_s_end_to_end"] == 200.0  # 5000 tokens in a 25 s run
    assert floors.run_figures({}, output_tokens=5000)["rollout_tok_s_end_to_end"] is None
    assert r["kv_migrations"] == 2 and r["scores"] == [0.5, 0.75]
    r.update(floor_to_training_s=0.1, floor_to_rollout_s=0.6, push_floor_s=0.2, rollout_efficiency=0.79)
    g = floors.against_goals(r)
    assert g["to_training_within_2x_floor_plus_1s"] is True  # 0.6 <= 1.2
    assert g["to_rollout_within_2x_floor_plus_1s"] is True  # 2.0 <= 2 x 0.6 + 1
    assert g["push_within_2x_floor_plus_0_5s"] is True  # 0.3 <= 0.9
    assert g["kv_migrations_at_least_1"] is True
    assert g["rollout_efficiency_at_least_0_8"] is False  # 0.79 < 0.8
    assert floors.against_goals({**r, "rollout_efficiency": 0.8})["rollout_efficiency_at_least_0_8"] is True
    assert floors.against_goals({})["kv_migrations_at_least_1"] is None
    assert floors.against_goals({})["rollout_efficiency_at_least_0_8"] is None


def test_switch_parts_from_the_cells_logs(tmp_path: Path) -> None:
    (tmp_path / "cell-0.log").write_text(
        "2026-12-01 10:00:00,000 gyre.cell INFO cell 0: now TRAINING (0.30s)\n"
        '2026-12-01 10:00:00,000 gyre.cell INFO switch parts {"cell": 0, "to": "TRAINING", "release_s": 0.25, "join_s": 0.05}\n'
        '2026-12-01 10:00:05,000 gyre.cell INFO switch parts {"cell": 0, "to": "ROLLOUT", "leave_s": 0.0, "resume_s": 0.5, "weights_s": 1.5}\n'
        "switch parts {not json\n"
    )
    (tmp_path / "cell-1.log").write_text(
        'x switch parts {"cell": 1, "to": "TRAINING", "release_s": 0.75, "join_s": 0.15}\n'
    )
    p = floors.switch_parts(tmp_path)
    assert p["to_training"]["count"] == 2 and p["to_training"]["median"] == {"join_s": 0.1, "release_s": 0.5}
    assert p["to_rollout"]["median"] == {"leave_s": 0.0, "resume_s": 0.5, "weights_s": 1.5}


def test_standalone_tokens_per_second_at_the_runs_concurrency() -> None:
    """The in-run figure is compared with the standalone engine at the run's own mean concurrency,
    interpolated linearly between measured concurrencies and clamped to their range (worked by hand)."""
    by = {"1": 100.0, "4": 400.0, "32": 2000.0}
    assert floors.at_concurrency(by, 2.5) == 250.0
    assert floors.at_concurrency(by, 18.0) == 1200.0  # 400 + 1600 * 14/28
    assert floors.at_concurrency(by, 0.3) == 100.0 and floors.at_concurrency(by, 64) == 2000.0
    with pytest.raises(ValueError):
        floors.at_concurrency({}, 3)
