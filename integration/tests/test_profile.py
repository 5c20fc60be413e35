"""The profile harness's plans: drawn from the `[profile]` lognormals with the run's seed, the same for
the same place in the run (what the simulator counts), within their bounds, with the duration profile's
tool time spread over the calls; the reward rule; the filler text's size in the policy's tokens."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from gyre.config.runconfig import Config, ConfigError, ProfileSection, config_from_dict
from gyre.rollout.agents import profile
from hypothesis import given
from hypothesis import strategies as st


@given(st.integers(0, 2**31), st.integers(0, 50), st.integers(0, 50), st.integers(0, 50), st.floats(0, 1e4))
def test_plans_are_deterministic_bounded_and_spend_the_tool_time(
    seed: int, k: int, q: int, j: int, tool_s: float
) -> None:
    p = ProfileSection()
    a, b = profile.plan(p, seed, k, q, j, tool_s), profile.plan(p, seed, k, q, j, tool_s)
    assert a == b and a.calls == profile.calls_of(p, seed, k, q, j)
    assert p.calls_min <= a.calls <= p.calls_max
    assert all(p.output_min <= n <= p.output_max for n in a.outputs)
    assert all(p.tool_tokens_min <= n <= p.tool_tokens_max for n in a.tool_tokens)
    assert sum(a.tool_s) == pytest.approx(tool_s, rel=1e-9, abs=1e-9)
    assert len(a.tool_s) == len(a.tool_tokens) == len(a.subagent) == a.calls


def test_the_profile_draws_its_medians_and_the_simulator_sees_the_same_calls() -> None:
    p = ProfileSection()
    calls = profile.calls_array(p, 7, (20, 8, 8))
    assert calls.shape == (20, 8, 8)
    assert abs(float(np.median(calls)) - p.calls_median) <= 1
    assert int(calls[3, 2, 1]) == profile.calls_of(p, 7, 3, 2, 1)
    outs = [n for j in range(200) for n in profile.plan(p, 7, 0, 0, j, 1.0).outputs]
    assert abs(float(np.median(outs)) - p.output_median) <= 0.1 * p.output_median
    subs = [s for j in range(200) for s in profile.plan(p, 7, 0, 0, j, 1.0).subagent]
    assert abs(sum(subs) / len(subs) - p.subagent_share) < 0.05


def test_the_reward_is_the_share_of_digits() -> None:
    assert profile.score_text("12 ab") == pytest.approx(0.5)
    assert profile.score_text("") == 0.0 and profile.score_text(None) == 0.0
    assert profile.score_text("007") == 1.0


def test_filler_text_is_about_the_asked_number_of_tokens(tmp_path: Path) -> None:
    from gyre_engine.server.model_factory import create_model
    from tokenizers import Tokenizer

    d = create_model(tmp_path / "m", "tiny")
    f = profile.Filler(d)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    for n in (20, 500, 3000):
        got = len(tok.encode(f.text(random.Random(n), n)).ids)
        assert 0.8 * n <= got <= 1.2 * n, (n, got)


def test_profile_settings_are_checked_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"\[profile\] output_min"):
        config_from_dict({"profile": {"output_min": 500, "output_max": 400}})
    with pytest.raises(ConfigError, match=r"unknown key 'calls'"):
        config_from_dict({"profile": {"calls": 3}})
    assert Config().profile == ProfileSection()
    # a profile whose contexts outgrow the micro-batch budget: its longest executions could not be trained
    long = {
        "agent": {"harness": "profile"},
        "profile": {"context_max": 32768},
        "train": {"token_budget": 16384},
    }
    with pytest.raises(ConfigError, match=r"context_max \(32768\) is over \[train\] token_budget"):
        config_from_dict(long)
    config_from_dict({**long, "train": {"token_budget": 32768, "chunk_budget": 8192}})
    config_from_dict({**long, "agent": {"harness": "builtin"}})  # other harnesses' contexts are their own


def test_the_simulator_counts_each_executions_planned_calls() -> None:
    """A profile run's executions last their tool time plus their own planned calls at the measured
    seconds per call (calibrated per planned call), not `turns` calls each."""
    from gyre.measure import predict

    cfg = config_from_dict({"agent": {"harness": "profile"}, "run": {"steps": 2}})
    calls = profile.calls_array(cfg.profile, cfg.run.seed, (2, cfg.batch.queries, cfg.batch.group_size))
    d = predict.durations(cfg)
    # one finished execution per place, its wall time = tool time + 0.5 s per planned call
    outcomes = [
        {"timed_out": False, "error": "", "calls": 99, "start": 0.0, "tool_s": 1.0, "where": [k, q, j],
         "end": 1.0 + 0.5 * int(calls[k, q, j])}
        for k, q, j in np.ndindex(*calls.shape)
    ]  # fmt: skip
    cal = predict.calibrate(
        [{"outcomes": outcomes, "steps": [], "switch_times": {"to_training_s": [], "to_rollout_s": []}}],
        calls,
    )
    assert cal.model_call_s == pytest.approx(0.5)
    got = predict.sim_durations(cfg, cal, calls)
    np.testing.assert_allclose(got, d * (1 - cfg.agent.model_fraction) + calls * 0.5)
    assert not np.allclose(got, predict.sim_durations(cfg, cal))  # `turns` calls each is another sample


def test_executions_that_ended_at_the_timeout_calibrate_per_call_they_made() -> None:
    """When every execution ends at its timeout (a slow engine), the seconds per call still come from
    them: their model time over the calls they made by then, not over the calls they planned."""
    from gyre.measure import predict

    calls = np.full((1, 1, 2), 20)
    outcomes = [
        {"timed_out": True, "error": "", "calls": 5, "start": 0.0, "tool_s": 10.0, "where": [0, 0, j],
         "end": 10.0 + 5 * 3.0}
        for j in range(2)
    ]  # fmt: skip
    outcomes.append(  # an execution that failed says nothing about call times
        {"timed_out": False, "error": "boom", "calls": 1, "start": 0.0, "tool_s": 0.0, "where": [0, 0, 0],
         "end": 100.0}
    )  # fmt: skip
    cal = predict.calibrate(
        [{"outcomes": outcomes, "steps": [], "switch_times": {"to_training_s": [], "to_rollout_s": []}}],
        calls,
    )
    assert cal.model_call_s == pytest.approx(3.0)
