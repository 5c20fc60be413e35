"""A push's end from the cells' own records of the versions their engines took (`cells/<id>.versions.jsonl`),
against the sampler's ticks: the engines serving rollout when the step was applied count, the slowest of
them ends the push, and a serving cell with no record leaves the sampled figure standing."""

from __future__ import annotations

import json
from pathlib import Path

from gyre.measure.runmetrics import push_reached, push_served, read_versions
from gyre.measure.samples import Sample
from gyre_sched.protocol import Role

RO, TR = int(Role.ROLLOUT), int(Role.TRAINING)


def _samples() -> list[Sample]:
    """Cell 0 trains, cells 1 and 2 serve rollout; the sampler ticks every 0.2 s from t=10."""
    out = []
    for k in range(8):
        t = 10.0 + 0.2 * k
        out.append(
            Sample(
                t=t,
                roles={0: TR, 1: RO, 2: RO},
                engine_busy={0: False, 1: True, 2: True},
                engine_version={0: "-1", 1: "1" if t >= 10.6 else "0", 2: "1" if t >= 10.4 else "0"},
            )
        )
    return out


def _write(out: Path, recs: list[dict[str, float]]) -> None:
    (out / "cells").mkdir(parents=True, exist_ok=True)
    for r in recs:
        with open(out / "cells" / f"{int(r['cell'])}.versions.jsonl", "a") as f:
            f.write(json.dumps(r) + "\n")


def test_the_slowest_serving_engine_ends_the_push(tmp_path: Path) -> None:
    _write(
        tmp_path,
        [
            {"cell": 1, "version": 1, "asked": 10.05, "served": 10.47, "pull_s": 0.31},
            {"cell": 2, "version": 1, "asked": 10.05, "served": 10.33, "pull_s": 0.22},
            {"cell": 0, "version": 1, "asked": 12.0, "served": 13.0, "pull_s": 0.9},  # training: not counted
            {"cell": 1, "version": 2, "asked": 11.0, "served": 11.2, "pull_s": 0.1},
        ],
    )
    versions = read_versions(tmp_path)
    assert sorted(versions) == [0, 1, 2] and len(versions[1]) == 2
    served = push_served(_samples(), versions, 10.02, 1)
    assert served is not None
    push_s, parts = served
    assert abs(push_s - 0.45) < 1e-9 and parts["pull_s_max"] == 0.31
    # The sampler saw both engines at version 1 only at its 10.6 tick: 0.58 s, 0.13 s late.
    assert abs(push_reached(_samples(), 10.02, 1)[0] - 10.02 - 0.58) < 1e-9


def test_a_newer_version_taken_ends_an_older_push(tmp_path: Path) -> None:
    """An engine that skipped version 1 (it took 2 first) served 1's weights from when it took 2."""
    _write(
        tmp_path,
        [
            {"cell": 1, "version": 2, "asked": 10.1, "served": 10.5, "pull_s": 0.3},
            {"cell": 2, "version": 1, "asked": 10.1, "served": 10.2, "pull_s": 0.1},
        ],
    )
    served = push_served(_samples(), read_versions(tmp_path), 10.0, 1)
    assert served is not None and abs(served[0] - 0.5) < 1e-9


def test_a_serving_cell_without_a_record_leaves_the_sampled_figure(tmp_path: Path) -> None:
    _write(tmp_path, [{"cell": 1, "version": 1, "asked": 10.1, "served": 10.5, "pull_s": 0.3}])
    assert push_served(_samples(), read_versions(tmp_path), 10.0, 1) is None
    assert read_versions(tmp_path / "nowhere") == {}
    # Nobody serving rollout after the step: no push to time.
    assert push_served([], read_versions(tmp_path), 10.0, 1) is None


def test_the_parts_are_those_of_the_engine_that_ended_the_push(tmp_path: Path) -> None:
    """Cell 2 pulled longer but cell 1 served last: the parts are cell 1's, and they add up."""
    _write(
        tmp_path,
        [
            {"cell": 1, "version": 1, "asked": 10.62, "served": 11.02, "status_s": 0.58, "pull_s": 0.2,
             "apply_s": 0.15, "apply_wait_s": 0.12},
            {"cell": 2, "version": 1, "asked": 10.05, "served": 10.5, "status_s": 0.01, "pull_s": 0.3,
             "apply_s": 0.1},
        ],
    )  # fmt: skip
    served = push_served(_samples(), read_versions(tmp_path), 10.02, 1)
    assert served is not None
    push_s, parts = served
    assert abs(push_s - 1.0) < 1e-9
    assert parts["notice_s"] == 0.6 and parts["status_s"] == 0.58 and parts["apply_s"] == 0.15
    assert parts["apply_wait_s"] == 0.12 and parts["pull_s"] == 0.2 and parts["pull_s_max"] == 0.3
    assert parts["other_s"] is not None and abs(parts["other_s"] - 0.05) < 1e-9
    total = sum(v for k, v in parts.items() if k in ("notice_s", "pull_s", "apply_s", "other_s"))
    assert abs(total - push_s) < 1e-3


def test_records_without_apply_seconds_count_it_in_the_rest(tmp_path: Path) -> None:
    """A record of an engine that does not say its apply seconds (SGLang's one push figure)."""
    _write(tmp_path, [{"cell": 1, "version": 1, "asked": 10.1, "served": 10.5, "pull_s": 0.3},
                      {"cell": 2, "version": 1, "asked": 10.1, "served": 10.2, "pull_s": 0.1}])  # fmt: skip
    served = push_served(_samples(), read_versions(tmp_path), 10.0, 1)
    assert served is not None
    _, parts = served
    assert parts["apply_s"] is None and parts["apply_wait_s"] is None and parts["status_s"] is None
    assert parts["other_s"] is not None and abs(parts["other_s"] - 0.1) < 1e-9
