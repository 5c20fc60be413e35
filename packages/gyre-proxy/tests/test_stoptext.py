"""Stop sequences are never shown, streamed or not (`stoptext.py`): the text held back while it could still
become a stop sequence, released when it does not; the record keeps the exact ids, stop string included."""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest
from gyre_proxy.stoptext import shown_text
from gyre_traj.io import read_records
from gyre_traj.records import Call
from hypothesis import example, given, settings
from hypothesis import strategies as st

_alpha = st.text(alphabet="abST ", max_size=24)


@settings(max_examples=400, deadline=None)
@given(text=_alpha, stops=st.lists(st.text(alphabet="abST ", min_size=1, max_size=4), max_size=3))
@example(text="one ST two STOP three", stops=["STOP"])
def test_shown_text_only_grows_and_never_shows_a_stop(text: str, stops: list[str]) -> None:
    """Over every prefix of an output (as chunks arrive): what is shown never contains a stop sequence,
    each shown text extends the one before, and the final text (SGLang's: cut before the first stop
    sequence) extends all of them."""
    final = shown_text(text, stops, final=True)
    first = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    assert final == text[:first]
    before = ""
    for n in range(len(text) + 1):
        now = shown_text(text[:n], stops, final=False)
        assert not any(s in now for s in stops)
        assert now.startswith(before) and final.startswith(now)
        before = now
    if not any(s in text for s in stops):  # an output that ended without one shows all of it
        assert final == text


def test_a_tail_that_only_starts_a_stop_sequence_is_shown_once_it_does_not() -> None:
    assert shown_text("alpha ST", ["STOP"], final=False) == "alpha "
    assert shown_text("alpha ST beta", ["STOP"], final=False) == "alpha ST beta"
    assert shown_text("alpha ST beta STO", ["STOP"], final=False) == "alpha ST beta "
    assert shown_text("alpha ST beta STOP gamma", ["STOP"], final=False) == "alpha ST beta "
    assert shown_text("alpha ST", ["STOP"], final=True) == "alpha ST"  # the output ended there
    assert shown_text("abc", [], final=False) == "abc"


SCRIPT = "alpha ST beta STOP gamma"  # the scripted engine ends the output with the stop string


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_never_shows_the_stop_sequence(
    engine: Any, make_proxy: Any, request: Any, stream: bool
) -> None:
    """The scripted engine streams a token per chunk, so the stop string arrives over several chunks
    (before the fix, the streamed text held " STOP" and the non-streamed reply did not)."""
    engine.script = [SCRIPT]
    ps = make_proxy([engine.url])
    client = anthropic.Anthropic(base_url=ps.url, api_key="k", max_retries=0)
    request.addfinalizer(client.close)
    kw: dict[str, Any] = {"model": "m", "max_tokens": 50, "stop_sequences": ["STOP"]}
    msgs: Any = [{"role": "user", "content": "go"}]
    if stream:
        with client.messages.stream(messages=msgs, **kw) as s:
            text = "".join(s.text_stream)
            final = s.get_final_message()
    else:
        final = client.messages.create(messages=msgs, **kw)
        text = "".join(b.text for b in final.content if b.type == "text")
    assert text == "alpha ST beta "
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "STOP"
    rec = [c for c in read_records(ps.log_path) if isinstance(c, Call)][-1]
    assert rec.output_ids.tolist() == engine.outputs[-1]  # the sampled ids, stop string included
    assert ps.proxy.tokenizer.decode(engine.outputs[-1]).endswith("STOP")


@pytest.mark.parametrize("stream", [False, True])
def test_openai_never_shows_the_stop_sequence(
    engine: Any, make_proxy: Any, request: Any, stream: bool
) -> None:
    engine.script = [SCRIPT]
    ps = make_proxy([engine.url])
    client = openai.OpenAI(base_url=f"{ps.url}/v1", api_key="k", max_retries=0)
    request.addfinalizer(client.close)
    kw: dict[str, Any] = {"model": "m", "max_tokens": 50, "stop": ["STOP"]}
    msgs: Any = [{"role": "user", "content": "go"}]
    if stream:
        pieces, finishes = [], []
        for ch in client.chat.completions.create(messages=msgs, stream=True, **kw):
            for c in ch.choices:
                pieces.append(c.delta.content or "")
                finishes.append(c.finish_reason)
        text, finish = "".join(pieces), [f for f in finishes if f]
    else:
        choice = client.chat.completions.create(messages=msgs, **kw).choices[0]
        text, finish = choice.message.content or "", [choice.finish_reason]
    assert text == "alpha ST beta " and finish == ["stop"]
    rec = [c for c in read_records(ps.log_path) if isinstance(c, Call)][-1]
    assert rec.output_ids.tolist() == engine.outputs[-1]
