"""The bench's stand-in engine streams what SGLang 0.5.23 streams (gyre-engine's
tests/fixtures/sglang-0.5.23/stream_proxy_request.json, recorded from sglang for the proxy's request shape):
chunk boundaries at the first token and then every `stream_interval` tokens, SGLang's fields on every chunk,
`e2e_latency` and `weight_versions` on the finished chunk only (it used to send `e2e_latency` always)."""

from __future__ import annotations

import json
from typing import Any

import httpx
from gyre_proxy.bench.run import TOOL_CALL, Server, bench_engine, sglang_chunks
from tokenizers import Tokenizer

# the meta_info keys of the recorded chunks (stream_proxy_request.json)
EVERY = {
    "id",
    "finish_reason",
    "prompt_tokens",
    "weight_version",
    "num_retractions",
    "input_token_logprobs",
    "output_token_logprobs",
    "output_token_logprobs_length",
    "reasoning_tokens",
    "completion_tokens",
    "cached_tokens",
    "cached_tokens_details",
    "dp_rank",
}
FIRST = EVERY | {"response_sent_to_client_ts"}
LAST = EVERY | {"e2e_latency", "weight_versions"}


def _chunks(sse: bytes) -> list[dict[str, Any]]:
    datas = [line[6:] for line in sse.decode().split("\n") if line.startswith("data: ")]
    assert datas[-1] == "[DONE]"
    return [json.loads(d) for d in datas[:-1]]


def test_chunks_fall_where_sglang_sends_them(tokenizer: Tokenizer) -> None:
    tok = tokenizer
    out = list(range(100, 130))  # 30 tokens, as in the recording
    assert [len(c["output_ids"]) for c in _chunks(sglang_chunks(tok, out, 4))] == [
        1,
        5,
        9,
        13,
        17,
        21,
        25,
        29,
        30,
    ]
    assert [len(c["output_ids"]) for c in _chunks(sglang_chunks(tok, out[:10], 4))] == [1, 5, 9, 10]
    assert [len(c["output_ids"]) for c in _chunks(sglang_chunks(tok, out, 1))] == list(range(1, 31))


def test_each_chunk_carries_sglangs_fields(tokenizer: Tokenizer) -> None:
    srv = Server(bench_engine(tokenizer))  # a real server on loopback
    try:
        body = {"rid": "r-1", "input_ids": [1], "sampling_params": {"stream_interval": 4}}
        r = httpx.post(f"{srv.url}/generate", json=body, timeout=30)
    finally:
        srv.stop()
    chunks = _chunks(r.content)
    assert len(chunks) > 2
    assert set(chunks[0]["meta_info"]) == FIRST
    assert all(set(c["meta_info"]) == EVERY for c in chunks[1:-1])
    assert set(chunks[-1]["meta_info"]) == LAST
    assert all(c["meta_info"]["id"] == "r-1" for c in chunks)
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    last = chunks[-1]
    assert last["meta_info"]["finish_reason"] == {"type": "stop", "matched": last["output_ids"][-1]}
    assert last["text"] == TOOL_CALL + "<|im_end|>"
    assert last["meta_info"]["weight_versions"] == [
        {"version": "1", "start": 0, "end": len(last["output_ids"])}
    ]
    n = [c["meta_info"]["completion_tokens"] for c in chunks]
    assert (
        n
        == [len(c["output_ids"]) for c in chunks]
        == [len(c["meta_info"]["output_token_logprobs"]) for c in chunks]
    )
