"""Logs of calls to OpenAI-compatible servers (vLLM's and SGLang's response shapes, streamed and not,
chat and completions, as `fixtures/make_fixtures.py` writes them) and Anthropic Messages: read with the
token ids the servers return when asked, refused without them, naming what is missing and the request
option that supplies it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gyre_traj.io import read_records, sniff_format
from gyre_traj.readers import iter_messages
from gyre_traj.records import Call, RecordError, Score
from gyre_traj.tree import Forest

FIXTURES = Path(__file__).parent / "fixtures" / "messages"


def _lines(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (FIXTURES / name).read_text().splitlines()]


def _read(lines: list[Any], **kw: Any) -> list[Call | Score]:
    return list(iter_messages([json.dumps(x) for x in lines], "log.jsonl", **kw))


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("*.jsonl")))
def test_every_log_is_told_apart_as_messages(name: str) -> None:
    assert sniff_format(FIXTURES / name) == "messages"


def test_a_vllm_agent_session_reads_as_one_tree() -> None:
    recs = list(read_records(FIXTURES / "vllm_chat.jsonl"))
    lines = _lines("vllm_chat.jsonl")
    calls = [r for r in recs if isinstance(r, Call)]
    assert [(c.execution_id, c.call_id, c.finish_reason) for c in calls] == [
        ("s-1", "chatcmpl-a1", "tool_calls"),
        ("s-1", "chatcmpl-a2", "stop"),
        ("s-2", "chatcmpl-b1", "stop"),
    ]
    for c, line in zip(calls, lines, strict=True):
        resp = line["response"]
        assert c.input_ids is not None and c.input_ids.tolist() == resp["prompt_token_ids"]
        assert c.output_ids.tolist() == resp["choices"][0]["token_ids"]
        want = [e["logprob"] for e in resp["choices"][0]["logprobs"]["content"]]
        np.testing.assert_allclose(c.output_logprobs, np.array(want, np.float32))
        assert c.t_end == resp["created"]
    assert [(s.execution_id, s.group_id, s.value) for s in recs if isinstance(s, Score)] == [
        ("s-1", "q-0", 1.0),
        ("s-2", "q-0", -2.0),
    ]
    tree = Forest().add_all(recs).trees["s-1"]
    assert len(tree.leaves()) == 1  # the second call's prompt extends the first call: one path
    assert tree.policy_tokens == calls[0].output_ids.size + calls[1].output_ids.size


def test_sglang_per_choice_ids_and_weight_version() -> None:
    recs = list(read_records(FIXTURES / "sglang_chat.jsonl"))
    calls = [r for r in recs if isinstance(r, Call)]
    assert [c.execution_id for c in calls] == ["s-3", "s-3"]  # the request's session_id
    assert [c.weight_version for c in calls] == [2, 2]  # the response's metadata.weight_version
    assert [r.value for r in recs if isinstance(r, Score)] == [0.5]


def test_a_vllm_stream_adds_up_its_chunks() -> None:
    (call,) = read_records(FIXTURES / "vllm_chat_stream.jsonl")
    chunks = _lines("vllm_chat_stream.jsonl")[0]["response"]
    assert isinstance(call, Call) and call.input_ids is not None
    assert call.input_ids.tolist() == chunks[0]["prompt_token_ids"]
    assert call.output_ids.tolist() == [t for ch in chunks for c in ch["choices"] for t in c["token_ids"]]
    assert call.finish_reason == "tool_calls" and call.output_ids.size == call.output_logprobs.size


def test_completions_with_two_choices_branch_from_one_prompt() -> None:
    recs = list(read_records(FIXTURES / "vllm_completions.jsonl"))
    assert [(r.call_id, r.execution_id) for r in recs if isinstance(r, Call)] == [
        ("cmpl-n2/0", "s-5"),
        ("cmpl-n2/1", "s-5"),
    ]
    tree = Forest().add_all(recs).trees["s-5"]
    assert len(tree.leaves()) == 2


def test_ids_from_the_request_and_from_token_id_logprob_tokens() -> None:
    """A completions request sent as ids gives the prompt; vLLM's `token_id:<id>` logprob tokens give
    the output when `token_ids` was not asked for."""
    line = _lines("vllm_completions.jsonl")[0]
    for choice in line["response"]["choices"]:
        del choice["prompt_token_ids"], choice["token_ids"]
    calls = [r for r in _read([line]) if isinstance(r, Call)]
    assert calls[0].input_ids is not None and calls[0].input_ids.tolist() == line["request"]["prompt"]
    assert calls[1].output_ids.tolist() == [
        int(t.split(":")[1]) for t in line["response"]["choices"][1]["logprobs"]["tokens"]
    ]
    line["response"]["choices"][0]["token_ids"] = [1, 2, 3]  # disagrees with its logprob tokens
    with pytest.raises(RecordError, match="`token_ids` disagree with the `token_id:<id>` logprob tokens"):
        _read([line])


def test_a_response_without_ids_names_what_is_missing_and_how_to_ask_for_it() -> None:
    with pytest.raises(RecordError) as err:
        list(read_records(FIXTURES / "openai_no_ids.jsonl"))
    msg = str(err.value)
    assert ":1: no prompt token ids:" in msg and "`return_token_ids: true`" in msg
    assert "`return_prompt_token_ids: true`" in msg  # SGLang's request option
    assert (
        "no output token ids: each choice's `token_ids`" in msg
        and "`return_tokens_as_token_ids: true`" in msg
    )
    line = _lines("openai_no_ids.jsonl")[0]
    line["response"]["choices"][0]["logprobs"] = None
    with pytest.raises(
        RecordError, match=r"no output logprobs: each choice's `logprobs` \(request `logprobs: true`\)"
    ):
        _read([line])


def test_anthropic_messages_need_the_loggers_ids() -> None:
    with pytest.raises(RecordError) as err:
        list(read_records(FIXTURES / "anthropic_no_ids.jsonl"))
    msg = str(err.value)
    assert "Anthropic Messages response carries no token ids or logprobs" in msg
    assert "add `prompt_token_ids`, `token_ids` and `output_logprobs` to the log line" in msg
    call, score = read_records(FIXTURES / "anthropic_with_ids.jsonl")
    line = _lines("anthropic_with_ids.jsonl")[0]
    assert isinstance(call, Call) and call.input_ids is not None
    assert (
        call.input_ids.tolist() == line["prompt_token_ids"] and call.output_ids.tolist() == line["token_ids"]
    )
    assert call.finish_reason == "stop" and call.execution_id == "s-6"
    assert isinstance(score, Score) and score.value == 1.0


def test_lines_without_a_session_belong_to_the_files_execution(tmp_path: Path) -> None:
    path = tmp_path / "agent-7.jsonl"
    lines = _lines("vllm_chat.jsonl")
    for line in lines:
        del line["session_id"]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines[:2]))
    assert {r.execution_id for r in read_records(path)} == {"agent-7"}
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))  # the third line's reward disagrees
    with pytest.raises(
        RecordError, match=r"agent-7\.jsonl:3: execution 'agent-7' has reward -2.0, but .*:2 gave it 1.0"
    ):
        list(read_records(path))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda x: x.update(reward=float("inf")), r"log\.jsonl:1: `reward` is inf"),
        (lambda x: x.update(role="boss"), r":1: unknown role 'boss'"),
        (
            lambda x: x.update(weight_version="latest"),
            r"`weight_version` must be an integer or a string of digits",
        ),
        (lambda x: x.update(response=[]), r"a streamed response with no chunk"),
        (lambda x: x.update(response={"id": "x"}), r"not a chat or text completion \(no `choices`\)"),
        (
            lambda x: x["response"]["choices"][0]["logprobs"]["content"][0].update(logprob=0.5),
            r"logprobs must be <= 0",
        ),
        (
            lambda x: x["response"]["choices"][0]["logprobs"]["content"][0].update(logprob=None),
            r"has a null entry",
        ),
        (
            lambda x: x["response"]["choices"][0].update(token_ids=[1]),
            r"\d+ output logprobs for 1 output ids",
        ),
        (
            lambda x: x["response"].update(prompt_token_ids=[-1]),
            r"`prompt_token_ids` contain a negative id -1",
        ),
    ],
)
def test_bad_lines_are_refused_naming_the_field(change: Any, message: str) -> None:
    line = _lines("vllm_chat.jsonl")[0]
    change(line)
    with pytest.raises(RecordError, match=message):
        _read([line])


def test_a_reward_dict_takes_its_key() -> None:
    line = _lines("vllm_chat.jsonl")[1]
    line["reward"] = {"score": 0.25, "format": 1.0}
    assert [r.value for r in _read([line], reward_key="score") if isinstance(r, Score)] == [0.25]


def test_a_stream_chunk_whose_choice_index_is_not_an_integer_is_refused() -> None:
    # found by the trace readers' fuzz test: a list as a chunk's choice index raised a TypeError
    line = _lines("vllm_chat_stream.jsonl")[0]
    line["response"][2]["choices"][0]["index"] = []
    with pytest.raises(
        RecordError, match=r"log\.jsonl:1: stream chunk 2 has a choice `index` that is not an integer"
    ):
        _read([line])


def test_a_streamed_anthropic_response_also_needs_the_loggers_ids() -> None:
    line = _lines("anthropic_with_ids.jsonl")[0]
    line["response"] = [
        {
            "type": "message_start",
            "message": {
                "id": "msg_s",
                "type": "message",
                "role": "assistant",
                "content": [],
                "model": "m",
                "stop_reason": None,
                "usage": {"input_tokens": 1, "output_tokens": 0},
            },
        },
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Fixed."}},
        {"type": "content_block_stop", "index": 0},
        {
            "type": "message_delta",
            "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
            "usage": {"input_tokens": 1, "output_tokens": 4},
        },
        {"type": "message_stop"},
    ]
    call, _score = _read([line])
    assert isinstance(call, Call) and call.call_id == "msg_s" and call.finish_reason == "length"
    del line["token_ids"]
    with pytest.raises(RecordError, match="Anthropic Messages response carries no token ids"):
        _read([line])
