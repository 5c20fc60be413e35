"""Records over ZeroMQ PUSH and in the fsynced log (there before the response is read), the classifier,
and the control link against the real gyre-sched Scheduler (a registered cell's engine gets routed to)."""

from __future__ import annotations

import threading
import time
from typing import Any

import anthropic
import numpy as np
import zmq
from gyre_proxy.chat import Conversation, Kind, Turn
from gyre_proxy.classify import classify, classify_claude_code
from gyre_proxy.config import ProxyConfig
from gyre_sched.policy import WaterLevelConfig, WaterLevelPolicy
from gyre_sched.protocol import Codec as SchedCodec
from gyre_sched.protocol import Hello, PeerKind, Welcome
from gyre_sched.service import Scheduler, ServiceConfig
from gyre_traj.io import Codec, read_records
from gyre_traj.records import Call, Role


def test_records_pushed_and_logged_before_the_response(engine: Any, make_proxy: Any, request: Any) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    port = pull.bind_to_random_port("tcp://127.0.0.1")

    def close() -> None:
        pull.close()
        ctx.term()

    request.addfinalizer(close)
    engine.script = ["first answer", "second answer"]
    ps = make_proxy([engine.url], record_push=f"tcp://127.0.0.1:{port}")
    client = anthropic.Anthropic(base_url=ps.url, api_key="k", max_retries=0)
    request.addfinalizer(client.close)
    msgs: list[Any] = [{"role": "user", "content": "hello"}]
    for i in range(2):
        r = client.messages.create(
            model="m", max_tokens=30, messages=msgs, extra_headers={"x-gyre-execution": "ex-p"}
        )
        on_disk = [c for c in read_records(ps.log_path) if isinstance(c, Call)]
        assert len(on_disk) == i + 1  # the record was on disk when the response arrived
        msgs += [{"role": "assistant", "content": r.content[0].text}, {"role": "user", "content": "more"}]  # type: ignore[union-attr]
    codec = Codec()
    got = []
    deadline = time.monotonic() + 10
    while len(got) < 2 and time.monotonic() < deadline:
        if pull.poll(100):
            got.append(codec.decode_msgpack(pull.recv()))
    assert [g.call_id for g in got] == [c.call_id for c in read_records(ps.log_path) if isinstance(c, Call)]
    assert isinstance(got[1], Call) and got[1].input_delta is not None
    assert np.array_equal(got[0].output_ids, engine.outputs[0])


def test_classifiers() -> None:
    sdk_main = "x-anthropic-billing-header: cc_version=2.1.328.1; cc_entrypoint=sdk-cli;\n\nYou are a Claude agent, built on Anthropic's Claude Agent SDK."
    sub = "x-anthropic-billing-header: cc_version=2.1.328.2; cc_entrypoint=sdk-cli; cc_is_subagent=true;\n\nYou are a Claude agent, built on Anthropic's Claude Agent SDK.\n\nYou are an agent for Claude Code, Anthropic's official CLI for Claude."
    user = (Turn(Kind.USER, "fix the bug"),)
    summary = (
        *user,
        Turn(Kind.ASSISTANT, "done"),
        Turn(Kind.USER, "Your task is to create a detailed summary of the conversation so far."),
    )
    assert classify_claude_code(Conversation(sdk_main, (), user), {}) == (Role.MAIN, "main")
    assert (
        classify_claude_code(
            Conversation("You are Claude Code, Anthropic's official CLI for Claude.", (), user), {}
        )[0]
        is Role.MAIN
    )
    assert classify_claude_code(Conversation(sdk_main, (), summary), {})[0] is Role.MAIN_SUMMARY
    role, agent = classify_claude_code(Conversation(sub, (), user), {})
    assert role is Role.SUBAGENT and agent.startswith("sub-")
    other = classify_claude_code(Conversation(sub, (), (Turn(Kind.USER, "another task"),)), {})[1]
    assert other != agent  # parallel sub-agents stay apart
    assert classify_claude_code(Conversation(sub, (), summary), {})[0] is Role.SUBAGENT_SUMMARY
    names = ProxyConfig(tokenizer="").agent_headers
    assert classify(Conversation("", (), user), {"x-gyre-agent": "helper"}, names) == (
        Role.SUBAGENT,
        "helper",
    )
    assert (
        classify(Conversation("", (), user), {"x-gyre-role": "main_summary"}, names)[0] is Role.MAIN_SUMMARY
    )


def test_harness_given_agent_ids() -> None:
    """Forks of one state share their system prompt and first user turn, so the hash fallback gives them
    one agent id; Claude Code's `x-claude-code-agent-id` (sent on every sub-agent call, never on the main
    loop's) keeps them apart, and other harnesses' header names are configurable."""
    main_system = "You are a Claude agent, built on Anthropic's Claude Agent SDK."
    billing = (
        "x-anthropic-billing-header: cc_version=2.1.328.d9f; cc_entrypoint=sdk-cli; cc_is_subagent=true;"
    )
    fork = Conversation(main_system, (), (Turn(Kind.USER, "fix the bug"),), stripped=(("b", billing),))
    cc = {"x-claude-code-session-id": "s", "user-agent": "claude-cli/2.1.328 (external, sdk-cli)"}
    names = ProxyConfig(tokenizer="").agent_headers
    one = classify(fork, {**cc, "x-claude-code-agent-id": "a2269319c7e0c3615"}, names)
    two = classify(fork, {**cc, "x-claude-code-agent-id": "a8643955418f4e7fa"}, names)
    assert one == (Role.SUBAGENT, "a2269319c7e0c3615") and two == (Role.SUBAGENT, "a8643955418f4e7fa")
    fallback = classify(fork, cc, names)  # no header: the hash, the same for both forks
    assert fallback[0] is Role.SUBAGENT and fallback[1].startswith("sub-")
    main = Conversation(main_system, (), (Turn(Kind.USER, "fix the bug"),))
    assert classify(main, cc, names) == (Role.MAIN, "main")
    other = {"x-my-harness-agent": "worker-3"}
    assert classify(main, other, ("x-my-harness-agent",)) == (Role.SUBAGENT, "worker-3")


def test_real_scheduler_adds_a_cells_engine(engine: Any, make_proxy: Any, request: Any) -> None:
    cfg = ServiceConfig(bind="tcp://127.0.0.1:0", heartbeat_s=0.1, failure_timeout_s=5.0)
    sched = Scheduler(WaterLevelPolicy(WaterLevelConfig(hold_s=60.0, ready_fraction=1.0)), cfg)
    th = threading.Thread(target=sched.serve_forever, daemon=True)
    th.start()

    def stop() -> None:
        sched.stop()
        th.join(5.0)

    request.addfinalizer(stop)
    # a cell registers with its engine's endpoint (and keeps its heartbeat going)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    cell = ctx.socket(zmq.DEALER)
    cell.setsockopt(zmq.LINGER, 0)
    cell.connect(sched.endpoint)
    codec = SchedCodec()
    cell.send(codec.encode(Hello(PeerKind.CELL, cell_id=7, capacity=8, endpoint=engine.url)))
    assert cell.poll(5000) and isinstance(codec.decode(cell.recv()), Welcome)
    ps = make_proxy([], sched=sched.endpoint, pick_wait_s=10.0)
    engine.script = ["routed through the scheduler"]
    client = anthropic.Anthropic(base_url=ps.url, api_key="k", max_retries=0)
    request.addfinalizer(client.close)
    r = client.messages.create(model="m", max_tokens=30, messages=[{"role": "user", "content": "hi"}])
    assert r.content[0].type == "text" and r.content[0].text == "routed through the scheduler"
    assert [e.engine_id for e in ps.proxy.pool.engines.values()] == [7]  # type: ignore[union-attr]
    cell.close()
    ctx.term()
