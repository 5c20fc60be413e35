from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from gyre.metrics import Sample, role_accounting
from gyre.procs import ChildDied, ProcessGroup
from gyre.run import _switch_times
from gyre_sched.protocol import Role

R, D, TT, T, TR = (
    int(r) for r in (Role.ROLLOUT, Role.DRAINING, Role.TO_TRAINING, Role.TRAINING, Role.TO_ROLLOUT)
)


def _samples() -> list[Sample]:
    # Cell 0, one sample a second: rollout 0-2 s (work seen at 0 s), draining and to-training 2-4 s,
    # training 4-7 s, to-rollout 7-8 s, rollout again at 8 s.
    roles = [R, R, D, TT, T, T, T, TR, R]
    busy = [True, False, False, False, False, False, False, False, False]
    return [
        Sample(float(t), {0: r}, {0: b}, {0: "0"}) for t, (r, b) in enumerate(zip(roles, busy, strict=True))
    ]


def test_role_accounting_by_hand() -> None:
    # A step in progress from 4 s to 5 s: the intervals starting at 4 and 5 s count as busy.
    acc = role_accounting(_samples(), [(4.0, 5.0)], 0.0, 8.0)
    c = acc["per_cell"]["0"]
    assert c["rollout_s"] == 2.0 and c["training_s"] == 3.0 and c["switching_s"] == 3.0
    # 0-1 s counts as busy (work seen at one end of the interval), 1-2 s as idle
    assert c["rollout_busy_s"] == 1.0
    assert c["training_busy_s"] == 2.0  # samples at 4 and 5 lie inside the step
    assert acc["idle_rollout"] == 0.5
    assert acc["idle_training"] == pytest.approx(1 / 3, abs=1e-4)
    assert acc["switching_share"] == pytest.approx(3 / 8, abs=1e-4)


def test_switch_times_from_samples() -> None:
    st = _switch_times(_samples())
    assert st == {"to_training_s": [2.0], "to_rollout_s": [1.0]}


def test_a_dead_child_is_an_error_naming_it(tmp_path: Path) -> None:
    procs = ProcessGroup(tmp_path / "logs")
    try:
        procs.start("quitter", [sys.executable, "-c", "print('bye'); raise SystemExit(3)"])
        sleeper = procs.start("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"])
        deadline = time.monotonic() + 30
        with pytest.raises(ChildDied, match=r"quitter exited with code 3(.|\n)*bye"):
            while time.monotonic() < deadline:
                procs.check()
                time.sleep(0.05)
    finally:
        procs.close(timeout_s=5.0)
    assert sleeper.proc.returncode is not None  # stopped, not orphaned
