"""The proxy serving from an engine that streams exactly as SGLang 0.5.23 does.

`ReplayEngine` is a TEST FIXTURE: a real HTTP server on loopback that answers the proxy's /generate with a
stream recorded from sglang's own HTTP layer (gyre-engine's tests/fixtures/sglang-0.5.23, written by
scripts/sglang_fixtures.py for the very request shape the proxy sends: `stream_interval` 4, `no_stop_trim`,
special tokens kept, logprobs): cumulative `text`, `output_ids` and `output_token_logprobs`, SGLang's
bookkeeping fields on every chunk, `e2e_latency` and `weight_versions` only on the finished one. Only
`meta_info.id` is set to the request's rid, as SGLang does. Through the Anthropic and the OpenAI front,
streaming and not, the proxy returns the recorded finish and records exactly the recorded ids and
logprobs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import msgspec
import numpy as np
import openai
import pytest
from gyre_base.testing import AppThread
from gyre_traj.io import read_records
from gyre_traj.records import Call
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

FIXTURES = Path(__file__).resolve().parents[2] / "gyre-engine" / "tests" / "fixtures" / "sglang-0.5.23"


def recorded(name: str) -> dict[str, Any]:
    return dict(json.loads((FIXTURES / f"{name}.json").read_text()))


class ReplayEngine:
    """TEST FIXTURE: replays one recorded SGLang stream per /generate call (see the module docstring)."""

    def __init__(self) -> None:
        self.case = ""
        self.bodies: list[dict[str, Any]] = []

        async def generate(request: Request) -> Response:
            body = msgspec.json.decode(await request.body())
            self.bodies.append(body)
            out = b""
            for ev in recorded(self.case)["events"]:
                if isinstance(ev, dict):
                    ev = {**ev, "meta_info": {**ev["meta_info"], "id": body["rid"]}}
                    out += b"data: " + msgspec.json.encode(ev) + b"\n\n"
                else:
                    out += b"data: " + ev.encode() + b"\n\n"
            return Response(out, media_type="text/event-stream")

        async def ok(request: Request) -> Response:
            return Response(b"")

        async def model_info(request: Request) -> Response:
            return Response(
                msgspec.json.encode(recorded("model_info")["body"]), media_type="application/json"
            )

        app = Starlette(
            routes=[
                Route("/generate", generate, methods=["POST"]),
                Route("/abort_request", ok, methods=["POST"]),
                Route("/model_info", model_info),
                Route("/health", ok),
                Route("/ready", ok),
            ]
        )
        self.http = AppThread(app)
        self.url = self.http.url

    def stop(self) -> None:
        self.http.stop()


@pytest.fixture
def replay() -> Any:
    eng = ReplayEngine()
    yield eng
    eng.stop()


def last_chunk(case: str) -> dict[str, Any]:
    return [e for e in recorded(case)["events"] if isinstance(e, dict)][-1]


CASES = [
    # case, max_tokens asked, stop sequences, (Anthropic stop_reason, OpenAI finish_reason), record finish
    ("stream_proxy_request", 48, None, ("end_turn", "stop"), "stop"),
    ("stream_proxy_stop", 48, ["thanks"], ("stop_sequence", "stop"), "stop"),
    ("stream_proxy_length", 10, None, ("max_tokens", "length"), "length"),
]


def same_text(streamed: str, whole: str, stop: Any) -> bool:
    """The streamed text is the non-streamed one (a stop sequence's text is in neither)."""
    return streamed == whole


def check_record(ps: Any, replay: ReplayEngine, case: str, finish: str) -> None:
    """The proxy asked for what the fixture was recorded with, and recorded exactly what SGLang sent."""
    sent = replay.bodies[-1]
    want = recorded(case)["request"]["body"]
    for key in ("stream_interval", "no_stop_trim", "skip_special_tokens", "max_new_tokens", "stop"):
        assert sent["sampling_params"].get(key) == want["sampling_params"].get(key), key
    assert sent["return_logprob"] is True and sent["stream"] is True
    last = last_chunk(case)
    rec = [c for c in read_records(ps.log_path) if isinstance(c, Call)][-1]
    assert rec.output_ids.tolist() == last["output_ids"]
    lps = last["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in lps] == last["output_ids"]
    assert np.array_equal(
        rec.output_logprobs, np.array([lp for lp, _, _ in lps], dtype=rec.output_logprobs.dtype)
    )
    assert rec.finish_reason == finish


@pytest.mark.parametrize(
    ("case", "max_tokens", "stop", "reasons", "finish"), CASES, ids=[c[0] for c in CASES]
)
def test_anthropic_front_streaming_and_not(
    replay: ReplayEngine, make_proxy: Any, request: Any, case: str, max_tokens: int, stop: Any, reasons: Any,
    finish: str,
) -> None:  # fmt: skip
    replay.case = case
    ps = make_proxy([replay.url])
    client = anthropic.Anthropic(base_url=ps.url, api_key="k", max_retries=0)
    request.addfinalizer(client.close)
    kw: dict[str, Any] = {"model": "m", "max_tokens": max_tokens}
    if stop:
        kw["stop_sequences"] = stop
    msgs = [{"role": "user", "content": "What is the answer?"}]
    r = client.messages.create(messages=msgs, **kw)
    assert r.stop_reason == reasons[0] and (r.stop_sequence or None) == (stop[0] if stop else None)
    text = "".join(b.text for b in r.content if b.type == "text")
    assert text and text in last_chunk(case)["text"]
    check_record(ps, replay, case, finish)
    with client.messages.stream(messages=msgs, **kw) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert final.stop_reason == reasons[0] and same_text(streamed, text, stop)
    check_record(ps, replay, case, finish)


@pytest.mark.parametrize(
    ("case", "max_tokens", "stop", "reasons", "finish"), CASES, ids=[c[0] for c in CASES]
)
def test_openai_front_streaming_and_not(
    replay: ReplayEngine, make_proxy: Any, request: Any, case: str, max_tokens: int, stop: Any, reasons: Any,
    finish: str,
) -> None:  # fmt: skip
    replay.case = case
    ps = make_proxy([replay.url])
    client = openai.OpenAI(base_url=f"{ps.url}/e/oa-1/v1", api_key="k", max_retries=0)
    request.addfinalizer(client.close)
    kw: dict[str, Any] = {"model": "m", "max_tokens": max_tokens, "temperature": 1.0, "top_p": 1.0}
    if stop:
        kw["stop"] = stop
    msgs: Any = [{"role": "user", "content": "What is the answer?"}]
    r = client.chat.completions.create(messages=msgs, **kw)
    choice = r.choices[0]
    assert choice.finish_reason == reasons[1]
    text = choice.message.content or ""
    assert text and text in last_chunk(case)["text"]
    check_record(ps, replay, case, finish)
    pieces, finishes = [], []
    for ch in client.chat.completions.create(messages=msgs, stream=True, **kw):
        for c in ch.choices:
            pieces.append(c.delta.content or "")
            finishes.append(c.finish_reason)
    assert same_text("".join(pieces), text, stop) and [f for f in finishes if f] == [reasons[1]]
    check_record(ps, replay, case, finish)


def test_a_stop_sequence_is_not_streamed_as_text(replay: ReplayEngine, make_proxy: Any, request: Any) -> None:
    replay.case = "stream_proxy_stop"
    ps = make_proxy([replay.url])
    client = anthropic.Anthropic(base_url=ps.url, api_key="k", max_retries=0)
    request.addfinalizer(client.close)
    kw: dict[str, Any] = {"model": "m", "max_tokens": 48, "stop_sequences": ["thanks"]}
    msgs = [{"role": "user", "content": "What is the answer?"}]
    whole = "".join(b.text for b in client.messages.create(messages=msgs, **kw).content if b.type == "text")
    with client.messages.stream(messages=msgs, **kw) as s:
        streamed = "".join(s.text_stream)
    assert streamed == whole
