from __future__ import annotations

import itertools
import sys
import time
from pathlib import Path

import pytest
from gyre.measure.efficiency import engine_time
from gyre.measure.metrics import role_accounting, role_bars
from gyre.measure.runmetrics import rollout_cells
from gyre.measure.runmetrics import switch_times as _switch_times
from gyre.measure.samples import Sample
from gyre.measure.trainwatch import TrainSample, TrainTrack, train_overlap
from gyre.procs.group import ChildDied, ProcessGroup
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
    # The core has work in hand from 4 s to 6 s (sampled every 0.5 s; a state holds until the next sample).
    track = TrainTrack([TrainSample(t / 2, 0, 8 <= t < 12) for t in range(16)])
    acc = role_accounting(_samples(), track, 0.0, 8.0)
    c = acc["per_cell"]["0"]
    assert c["rollout_s"] == 2.0 and c["training_s"] == 3.0 and c["switching_s"] == 3.0
    # 0-1 s counts as busy (work seen at one end of the interval), 1-2 s as idle
    assert c["rollout_busy_s"] == 1.0
    assert c["training_busy_s"] == 2.0  # 4-6 s of the 3 s in training
    assert acc["idle_rollout"] == 0.5
    assert acc["idle_training"] == pytest.approx(1 / 3, abs=1e-4)
    assert acc["switching_share"] == pytest.approx(3 / 8, abs=1e-4)


def test_timeline_bars_merge_each_stretch_by_hand() -> None:
    # `_samples`, with the core busy 4-6 s (sampled every 0.5 s): one bar a stretch, not one a sample
    track = TrainTrack([TrainSample(t / 2, 0, 8 <= t < 12) for t in range(16)])
    bars = role_bars(_samples(), track)
    assert bars == {
        (0, "r"): [(0.0, 1.0)],  # busy at one end of the interval
        (0, "r-idle"): [(1.0, 1.0)],
        (0, "s"): [(2.0, 2.0), (7.0, 1.0)],  # draining + to-training merge; to-rollout
        (0, "t-idle"): [(4.0, 3.0)],
        (0, "t"): [(4.0, 2.0)],  # four 0.5 s pieces of the core's samples, one bar
    }


def test_timeline_bars_of_a_long_run_are_as_many_as_its_changes_and_cover_it() -> None:
    # An hour sampled every 0.2 s on two cells, each switching every 10 minutes, the core sampled every
    # 0.05 s, at epoch seconds: bars come out one per stretch, and each kind's bars cover exactly its
    # sampled intervals.
    n, T0 = 18_000, 1.8e9
    samples = [
        Sample(T0 + i * 0.2, {0: R if (i // 3000) % 2 == 0 else T, 1: T if (i // 3000) % 2 == 0 else R},
               {0: True, 1: True}, {0: "0", 1: "0"})
        for i in range(n)
    ]  # fmt: skip
    track = TrainTrack([TrainSample(T0 + i * 0.05, 0, True) for i in range(4 * n)])
    bars = role_bars(samples, track)
    assert {k: len(v) for k, v in bars.items()} == {(0, "r"): 3, (0, "t-idle"): 3, (0, "t"): 3,
                                                    (1, "t-idle"): 3, (1, "t"): 3, (1, "r"): 3}  # fmt: skip
    total = {k: sum(w for _, w in v) for k, v in bars.items()}
    span = samples[-1].t - samples[0].t
    assert total[(0, "r")] + total[(0, "t-idle")] == pytest.approx(span, abs=1e-3)
    assert total[(0, "t")] == pytest.approx(total[(0, "t-idle")], abs=1e-3)
    for (_, _), v in bars.items():  # bars of one kind neither touch nor overlap (they would have merged)
        assert all(a0 + w0 < a1 for (a0, w0), (a1, _) in itertools.pairwise(v))


def test_train_overlap_by_hand() -> None:
    # Two cells: cell 0 trains 4-7 s (as in `_samples`), cell 1 joins it 5-6 s. Step 0 has work in hand
    # 4-6 s, step 1 6-7 s; batch 0's last execution ends at 4.5 s, batch 1's at 9 s.
    samples = [
        Sample(x.t, {0: x.roles[0], 1: T if x.t == 5.0 else R}, x.engine_busy, x.engine_version)
        for x in _samples()
    ]
    track = TrainTrack(
        [
            TrainSample(0.0, -1, False),
            TrainSample(4.0, 0, True),
            TrainSample(6.0, 1, True),
            TrainSample(7.0, -1, False),
        ]
    )
    outcomes = [{"step": 0, "end": 3.0}, {"step": 0, "end": 4.5}, {"step": 1, "end": 9.0}]
    ov = train_overlap(samples, track, outcomes, 0.0, 8.0)
    # busy cell-seconds: step 0: 4-5 s x 1 cell + 5-6 s x 2 cells = 3; step 1: 6-7 s x 1 cell = 1.
    # overlapping its own batch: step 0 4-4.5 s (0.5); step 1 all of it (1).
    assert ov["busy_cell_s"] == 4.0 and ov["overlap_cell_s"] == 1.5
    assert ov["train_overlap_share"] == 0.375
    assert ov["per_step"]["0"] == {
        "busy_cell_s": 3.0,
        "overlap_cell_s": 0.5,
        "train_first": 4.0,
        "batch_end": 4.5,
    }
    assert ov["per_step"]["1"]["overlap_cell_s"] == 1.0
    assert train_overlap(samples, TrainTrack([]), outcomes, 0.0, 8.0)["train_overlap_share"] is None


def test_switch_times_from_samples() -> None:
    st = _switch_times(_samples())
    assert st == {"to_training_s": [2.0], "to_rollout_s": [1.0]}


def test_rollout_cells_are_the_change_points_of_the_cells_in_rollout() -> None:
    """Cell 0 as in `_samples`, cell 1 in rollout throughout: two cells until 2 s, one until 8 s, then two
    again; seconds from the run's first batch (here at 1 s: the first sample comes before it)."""
    samples = [Sample(x.t, {**x.roles, 1: R}, x.engine_busy, x.engine_version) for x in _samples()]
    assert rollout_cells(samples, 1.0) == [[-1.0, 2], [1.0, 1], [7.0, 2]]
    assert rollout_cells([], 0.0) == []


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


def test_work_done_between_two_samples_counts_as_busy() -> None:
    """A tiny model computes a micro-batch in milliseconds, between two 0.05 s samples: the interval in
    which a step's `done` count rose is busy on that step (it used to read as idle, so a run whose
    training all fell between samples reported no training and no overlap). Worked by hand."""
    from gyre.measure.trainwatch import credit_done

    samples = [
        TrainSample(0.0, -1, False),
        TrainSample(1.0, 0, False, 2),  # two micro-batches of step 0 done in [0, 1)
        TrainSample(2.0, 0, False, 2),  # nothing more in [1, 2)
        TrainSample(3.0, 0, True, 2),
        TrainSample(4.0, 1, False, 1),  # step 1's first done in [3, 4), busy anyway
        TrainSample(5.0, 1, False, 3),  # two more in [4, 5)
    ]
    got = credit_done(samples)
    assert [(x.step, x.busy) for x in got] == [
        (0, True),
        (0, False),
        (0, False),
        (0, True),
        (1, True),
        (1, False),
    ]
    track = TrainTrack(samples)
    assert track.busy_s(0.0, 6.0) == 3.0  # [0, 1), [3, 4), [4, 5)


def test_a_step_applied_between_samples_counts_as_busy_and_a_skipped_one_not() -> None:
    """The core's queue position moving on between two samples means the earlier step was taken in
    between: trained if the weight version moved too, else skipped (nothing to train), which is no
    training at all (it used to be counted busy, and a run of empty steps reported training time)."""
    from gyre.measure.trainwatch import credit_done

    samples = [
        TrainSample(0.0, 0, False, 0, 0),
        TrainSample(1.0, 1, False, 0, 1),  # step 0 trained and applied in [0, 1): version 0 -> 1
        TrainSample(2.0, 2, False, 0, 1),  # step 1 skipped in [1, 2): the version stays
        TrainSample(3.0, 2, False, 0, 1),
    ]
    assert [(x.step, x.busy) for x in credit_done(samples)] == [(0, True), (1, False), (2, False), (2, False)]
    assert TrainTrack(samples).busy_s(0.0, 4.0) == 1.0


def test_engine_time_by_hand() -> None:
    """Counters of two engines over five samples: engine 0 in rollout throughout (it restarts between the
    last two samples: its counters start again from zero), engine 1 training after the second sample
    (its growth there does not count)."""
    R, T = int(Role.ROLLOUT), int(Role.TRAINING)

    def c(steps: int, tokens: int, dec: float, pre_tok: int, pre: float | None, waiting: int) -> dict:
        return {"decode_steps": steps, "decode_tokens": tokens, "decode_s": dec, "prefill_tokens": pre_tok,
                "prefill_s": pre, "evicted_tokens": None if pre is None else 10 * steps,
                "host_spilled_tokens": None if pre is None else 4 * steps,
                "host_hit_tokens": None if pre is None else 2 * steps, "waiting": waiting,
                "step_s": None if pre is None else dec + pre + 0.01 * steps,
                "command_s": None if pre is None else 0.02 * steps,
                "waiting_s": None if pre is None else {"long_slot": 0.1 * steps, "rows": 0.05 * steps},
                "graph_captures": None if pre is None else steps // 10,
                "graph_capture_s": None if pre is None else 0.5 * (steps // 10),
                "prefill_passes": None if pre is None else pre_tok // 100,
                "prefill_graph_passes": None if pre is None else pre_tok // 200}  # fmt: skip

    e0 = [c(0, 0, 0.0, 0, 0.0, 2), c(10, 80, 0.2, 1000, 0.1, 2), c(20, 160, 0.4, 1000, 0.1, 0),
          c(30, 240, 0.6, 3000, 0.3, 0), c(5, 40, 0.1, 0, 0.0, 0)]  # fmt: skip
    e1 = [c(0, 0, 0.0, 0, None, 0), c(4, 4, 0.5, 10, None, 0), c(99, 99, 9.0, 99, None, 0),
          c(99, 99, 9.0, 99, None, 0), c(99, 99, 9.0, 99, None, 0)]  # fmt: skip
    roles = [(R, R), (R, T), (R, T), (R, T), (R, T)]
    busy = [(True, True), (True, True), (True, False), (False, False), (True, False)]
    samples = [
        Sample(float(t), {0: r0, 1: r1}, {0: b0, 1: b1}, {0: "1", 1: "1"}, {0: e0[t], 1: e1[t]})
        for t, ((r0, r1), (b0, b1)) in enumerate(zip(roles, busy, strict=True))
    ]
    got = engine_time(samples, 0.0, 4.0)
    assert got["0"] == {
        "rollout_busy_s": 4.0,  # every interval has a busy end
        "decode_s": 0.7,  # 0.2 + 0.2 + 0.2, then 0.1 after the restart
        "prefill_s": 0.3,
        "computing_share": 0.25,
        "decode_steps": 35,
        "decode_ms_per_step": 20.0,
        "mean_decode_batch": 8.0,
        "decode_tok_s": 400.0,
        "prefill_tokens": 3000,
        "prefill_tok_s": 10000.0,
        "prefill_passes": 30,  # a pass per 100 prefilled tokens
        "prefill_ms_per_pass": 10.0,  # 0.3 s over 30 passes
        "prefill_graph_passes": 15,  # of those, one per 200 prefilled tokens
        "mean_waiting": 1.0,  # 2 queued in the first two of four seconds
        "evicted_tokens": 350,
        "host_spilled_tokens": 140,
        "host_hit_tokens": 70,
        "graph_captures": 3,  # one each 10 steps: 1 + 1 + 1, then 0 after the restart
        "graph_capture_s": 1.5,
        "step_s": 1.35,  # decode 0.7 + prefill 0.3 + 0.01 a decode step
        "command_s": 0.7,
        "step_other_s": 0.35,
        "idle_s": 1.95,  # 4 busy seconds less 1.35 in steps and 0.7 on calls
        "waiting_by_reason": {"long_slot": 0.88, "rows": 0.44},  # 3.5 and 1.75 request-seconds in 4 s
    }
    # engine 1: only its first second counts, and it does not time its prefill
    assert got["1"]["decode_s"] == 0.5 and got["1"]["decode_steps"] == 4 and got["1"]["rollout_busy_s"] == 1.0
    assert (
        got["1"]["prefill_s"] is None
        and got["1"]["prefill_tok_s"] is None
        and got["1"]["evicted_tokens"] is None
        and got["1"]["graph_captures"] is None
        and got["1"]["prefill_passes"] is None
        and got["1"]["prefill_ms_per_pass"] is None
        and got["1"]["prefill_graph_passes"] is None
        and got["1"]["idle_s"] is None  # a server that does not time its thread (SGLang)
        and got["1"]["waiting_by_reason"] is None
    )
    assert got["1"]["computing_share"] == 0.5
    # a window: the last two seconds only
    late = engine_time(samples, 2.0, 4.0)["0"]
    assert late["decode_steps"] == 15 and late["rollout_busy_s"] == 2.0
