"""The profile harness's plans: drawn from the `[profile]` lognormals with the run's seed, the same for
the same place in the run (what the simulator counts), within their bounds, with the duration profile's
tool time spread over the calls; the reward rule; the filler text's size in the policy's tokens."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import pytest
from gyre.config.runconfig import Config, ConfigError, ProfileSection, config_from_dict, load_config
from gyre.rollout.agents import profile
from gyre.rollout.agents.profile import SUB_CALLS
from hypothesis import given
from hypothesis import strategies as st

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
BENCH = Path(__file__).resolve().parents[1] / "bench"


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


def test_the_simulator_counts_every_call_an_execution_plans() -> None:
    """`planned_calls_array`: each execution's main-agent calls and its sub-agents' and summary calls, as
    the harness makes them when nothing cuts it short (the agent-shaped example: 15.0 an execution against
    11.5 of the main agent)."""
    cfg = load_config(EXAMPLES / "h200-agentic.toml")
    p, shape = cfg.profile, (cfg.run.steps, cfg.batch.queries, cfg.batch.group_size)
    every, main = (
        profile.planned_calls_array(p, cfg.run.seed, shape),
        profile.calls_array(p, cfg.run.seed, shape),
    )
    assert every[1, 2, 3] == profile.planned_calls(
        profile.plan(p, cfg.run.seed, 1, 2, 3, 5.0), p, p.prompt_tokens
    )
    assert (every >= main - 1).all() and every.mean() == pytest.approx(14.98, abs=0.01)
    assert main.mean() == pytest.approx(11.48, abs=0.01)


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


def test_executions_cut_by_the_timeout_count_the_tool_time_they_slept_and_their_overrun() -> None:
    """An outcome's `tool_s` is its whole plan's tool time; an execution cut by the timeout slept only the
    part before the calls it made. `gyre compare`'s calibration (`predicted`) subtracts that part, so the
    seconds per call are the ones the executions took (2.0 s here), leaves out an execution cut in its tool
    time (no call in flight: its share of the sleep in hand is unknown), and keeps the seconds past the
    timeout (the call in flight waited for) as the simulator's measured overrun."""
    from gyre.measure import predict
    from gyre.scenarios.compare import predicted

    timeout, call_s = 5.0, 2.0
    cfg = config_from_dict({"agent": {"harness": "profile", "timeout_s": timeout}, "run": {"steps": 1}})
    p = cfg.profile
    outcomes, over = [], []
    for k, q, j in np.ndindex(1, cfg.batch.queries, cfg.batch.group_size):
        made = 3 + j % 3  # sub-agents' calls count: they have no tool time before them
        plan = profile.plan(p, cfg.run.seed, k, q, j, 20.0)
        wall = profile.slept_s(plan, p, made, p.prompt_tokens) + made * call_s
        assert wall > timeout + 0.5 and profile.slept_s(plan, p, made, p.prompt_tokens) < 20.0
        outcomes.append({"timed_out": True, "error": "", "calls": made, "start": 100.0, "end": 100.0 + wall,
                         "tool_s": 20.0, "where": [k, q, j]})  # fmt: skip
        over.append(wall - timeout)
    for q in range(cfg.batch.queries):  # cut in its tool time before its second call: ended at the timeout
        outcomes.append({"timed_out": True, "error": "", "calls": 1, "start": 0.0, "end": timeout,
                         "tool_s": 20.0, "where": [0, q, 0]})  # fmt: skip
        over.append(0.0)
    m = {"config": cfg.to_dict(), "outcomes": outcomes, "steps": [], "roles": {}, "end_to_end_s": 60.0,
         "switch_times": {"to_training_s": [], "to_rollout_s": []}}  # fmt: skip
    cal = predicted(cfg, {"elastic": cfg}, {"elastic": [m]})["calibration"]
    assert cal["model_call_s"] == pytest.approx(call_s)
    q = np.quantile(over, np.linspace(0.0, 1.0, predict.OVERRUN_QUANTILES))
    np.testing.assert_allclose(cal["timeout_overrun_s"], q, atol=1e-3)
    # the simulator's executions cut by the timeout hold their slots for draws of those seconds
    drawn = predict.overruns(cfg, predict.Calibration(timeout_overrun_s=tuple(q)))
    assert drawn is not None and drawn.shape == (1, cfg.batch.queries, cfg.batch.group_size)
    assert drawn.min() >= 0.0 and drawn.max() <= max(over) and drawn.std() > 0
    assert predict.overruns(cfg, predict.Calibration()) is None


class _FakeOpenAI(ThreadingHTTPServer):
    """A loopback server answering `/e/{execution}/v1/chat/completions` as gyre-proxy does with
    `ignore_eos`: exactly `max_tokens` output words after `delay_s`, usage counting a word as a token."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.calls = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                outer.calls += 1
                time.sleep(outer.delay_s)
                n = int(body["max_tokens"])
                prompt = sum(len(str(m["content"]).split()) for m in body["messages"])
                out = {
                    "choices": [{"message": {"role": "assistant", "content": " ".join(["7"] * n)}}],
                    "usage": {"prompt_tokens": prompt, "completion_tokens": n},
                }
                data = json.dumps(out).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture(scope="module")
def filler(tmp_path_factory: pytest.TempPathFactory) -> profile.Filler:
    from gyre_engine.server.model_factory import create_model

    return profile.Filler(create_model(tmp_path_factory.mktemp("m") / "m", "tiny"))


def _run(
    server: _FakeOpenAI, filler: profile.Filler, p: ProfileSection, plan: profile.Plan, timeout_s: float
) -> tuple[profile.ProfileExecution, bool, float]:
    task = filler.text(random.Random(1), p.prompt_tokens)
    ex = profile.ProfileExecution("s0-q0-e0", "s0-q0", task, sum(plan.tool_s), plan)

    async def go() -> None:
        async with httpx.AsyncClient(timeout=10.0) as http:
            await asyncio.wait_for(
                profile.run_profile(http, server.url, ex, p, filler, temperature=1.0, retry_for_s=1.0),
                timeout=timeout_s,
            )

    t0 = time.monotonic()
    try:
        asyncio.run(go())
    except TimeoutError:
        return ex, True, time.monotonic() - t0
    return ex, False, time.monotonic() - t0


def test_an_execution_whose_plan_fits_its_timeout_makes_every_planned_call(filler: profile.Filler) -> None:
    """The profile harness against a loopback server answering each call in 20 ms: an execution whose
    planned seconds (its tool time + its calls x 20 ms) fit the timeout ends on its own, having made
    every call its plan makes (sub-agents' and summaries' included); one whose plan does not fit is cut
    at the timeout with the calls that fitted."""
    p = dataclasses.replace(
        load_config(EXAMPLES / "profile-cpu.toml").profile, calls_median=8.0, calls_min=6, calls_max=12
    )
    start = len(profile.SYSTEM.split()) + p.prompt_tokens
    server = _FakeOpenAI(delay_s=0.02)
    try:
        kinds = set()
        for j in range(4):
            plan = profile.plan(p, 3, 0, 0, j, tool_s=0.1)
            n = profile.planned_calls(plan, p, start, wrap_tokens=2)
            kinds |= {"sub"} if any(plan.subagent) else set()
            kinds |= {"compact"} if n > plan.calls + SUB_CALLS * sum(plan.subagent[: plan.calls]) else set()
            need = profile.planned_s(plan, p, start, 0.02)
            ex, timed_out, took = _run(server, filler, p, plan, timeout_s=4 * need + 1.0)
            assert not timed_out and ex.calls == n, (j, ex.calls, n)
            assert took >= need
            # the same plan with a timeout of half its planned seconds: cut, with fewer calls
            ex, timed_out, _ = _run(server, filler, p, plan, timeout_s=need / 2)
            assert timed_out and 0 < ex.calls < n
        assert kinds == {"sub", "compact"}  # the plans took both branches
    finally:
        server.shutdown()
        server.server_close()


def test_the_agentic_example_times_out_a_tail_at_the_measured_call_time() -> None:
    """examples/h200-agentic.toml against the H200's measured decode (the committed probe: a step of the
    engine's full batch of 16 at a 14k context, full slot widths, and the prefill of each call's tool
    output at that batch): its executions' planned seconds pass `[agent] timeout_s` for a tail of them,
    not for all (the config's comments give the arithmetic)."""
    from gyre.measure import predict

    cfg = load_config(EXAMPLES / "h200-agentic.toml")
    probe = json.loads((BENCH / "results-h200-decode-probe.json").read_text())
    full = probe["decode_vs_context"]["full"]["14336"]
    # decode of the median output at the full batch + the batch's prefill of one tool output each
    prefill_per_token = full["prefill_s"] / (full["batch"] * 14336)
    call_s = cfg.profile.output_median * full["step_ms"] / 1000.0 + (
        full["batch"] * cfg.profile.tool_tokens_median * prefill_per_token
    )
    assert 3.0 < call_s < 4.0
    tool = predict.durations(cfg) * (1.0 - cfg.agent.model_fraction)
    start = cfg.profile.prompt_tokens + 40  # the system prompt, the task's first line, the chat template
    need = np.array(
        [
            profile.planned_s(profile.plan(cfg.profile, cfg.run.seed, k, q, j, float(tool[k, q, j])), cfg.profile,
                              start, call_s)
            for k, q, j in np.ndindex(*tool.shape)
        ]
    )  # fmt: skip
    cut = float(np.mean(need > cfg.agent.timeout_s))
    assert 0.0 < cut <= 0.2, cut
    assert np.mean(need > 45.0) > 0.8  # the earlier 45 s timeout cut most executions even at this speed
    # the nominal duration the simulator starts from is about the planned one
    assert 0.8 <= float(np.median(predict.durations(cfg))) / float(np.median(need)) <= 1.25
