"""gyre-engine answers as SGLang 0.5.23 does (its recorded replies are the reference: tests/fixtures): the
values SGLang accepts (`null`, per-request lists in a batch), `token_ids_logprob`, /model_info's fields,
and the shape of a stream (which chunks go out, and which fields each carries)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent))  # the shared helpers (tests run with --import-mode=importlib)
from sglang_shapes import events, fixture  # noqa: E402

USER = [1200 + i * 7 for i in range(9)]
TOOL = [1400 + i * 3 for i in range(15)]


def post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/generate", json=body, timeout=60)


def stream(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{url}/generate", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        data = [ln[5:].strip() for ln in r.iter_lines() if ln.startswith("data:")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def forward_logprobs(hf_model: Any, ids: list[int], out: list[int], temperature: float = 1.0) -> Any:
    """log-softmax of the reference model's logits at each output position ([len(out), vocab])."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids + out])).logits[0, len(ids) - 1 : -1]
    return torch.log_softmax(logits / temperature, dim=-1)


def test_nulls_sglang_accepts_mean_the_defaults(server: Any, greedy: Any) -> None:
    body = {
        "input_ids": USER,
        "sampling_params": {"max_new_tokens": 5, "temperature": None, "top_p": None, "stop": None},
        "return_logprob": None,
        "top_logprobs_num": None,
        "logprob_start_len": None,
        "stream": None,
        "rid": None,
    }
    r = post(server.url, body)
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert meta["completion_tokens"] == 5 and "output_token_logprobs" not in meta
    # max_new_tokens null is SGLang's "no limit": here a stop token ends it
    stop = greedy(USER, 8)[3]
    body = {
        "input_ids": USER,
        "sampling_params": {"max_new_tokens": None, "temperature": 0, "stop_token_ids": [stop]},
    }
    r = post(server.url, body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["output_ids"] == greedy(USER, 8)[: greedy(USER, 8).index(stop) + 1]
    assert got["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert fixture("generate_nulls")["status"] == 200  # SGLang takes the same nulls


def test_a_null_length_limit_is_bounded_by_the_context_as_in_sglang() -> None:
    """SGLang caps every request at `context_len - len(input_ids) - 1` new tokens (init_req_max_new_tokens)."""
    from gyre_engine.protocol import GenerateRequest
    from gyre_engine.server.parse import parse_generate

    req = GenerateRequest(input_ids=[1] * 10, sampling_params={"max_new_tokens": None})
    (er,) = parse_generate(req, lambda s: [], context_len=64)
    assert er.max_new_tokens == 64 - 10 - 1


def test_batch_takes_per_request_logprob_settings(server: Any) -> None:
    body = {
        "input_ids": [USER, TOOL],
        "sampling_params": {"max_new_tokens": 3, "temperature": 0},
        "return_logprob": [True, False],
        "top_logprobs_num": [2, 0],
    }
    r = post(server.url, body)
    assert r.status_code == 200, r.text
    a, b = r.json()
    assert (
        len(a["meta_info"]["output_token_logprobs"]) == 3
        and len(a["meta_info"]["output_top_logprobs"][0]) == 2
    )
    assert "output_token_logprobs" not in b["meta_info"]
    sg = fixture("generate_batch")["body"]  # SGLang's answer to the same shape of request
    assert "output_token_logprobs" in sg[0]["meta_info"] and not sg[1]["meta_info"].get(
        "output_token_logprobs"
    )
    r = post(server.url, {**body, "return_logprob": [True, False, True]})
    assert r.status_code == 400 and "return_logprob has 3 values for 2 inputs" in r.json()["error"]["message"]


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_token_ids_logprob_gives_those_ids_logprobs_at_each_position(
    server: Any, hf_model: Any, temperature: float
) -> None:
    want = [7, 300, 1201]
    sp = {"max_new_tokens": 6, "temperature": temperature, "sampling_seed": 3, "ignore_eos": True}
    body = {"input_ids": USER, "sampling_params": sp, "return_logprob": True, "token_ids_logprob": want}
    r = post(server.url, body)
    assert r.status_code == 200, r.text
    out, meta = r.json()["output_ids"], r.json()["meta_info"]
    rows = meta["output_token_ids_logprobs"]
    assert len(rows) == len(out) and all([t for _, t, _ in row] == want for row in rows)
    # greedy rows report the plain log-softmax; sampled rows the tempered one (as for the token's own)
    ref = forward_logprobs(hf_model, USER, out, temperature or 1.0)[:, want]
    assert torch.allclose(torch.tensor([[lp for lp, _, _ in row] for row in rows]), ref, atol=1e-4)
    # the same rows, cumulative, in a stream
    chunks = stream(server.url, body)
    assert chunks[-1]["meta_info"]["output_token_ids_logprobs"] == rows
    assert all(len(c["meta_info"]["output_token_ids_logprobs"]) == len(c["output_ids"]) for c in chunks)
    bad = post(server.url, {**body, "token_ids_logprob": [5, 99999]})
    assert bad.status_code == 400 and "out-of-vocabulary token id 99999" in bad.json()["error"]["message"]
    sg = fixture("generate_token_ids_logprob")["body"]["meta_info"]["output_token_ids_logprobs"]
    assert all(len(e) == 3 for row in sg for e in row)  # SGLang's entries: [logprob, id, text or null]


def test_refusals_use_sglangs_words(server: Any) -> None:
    ctx = httpx.get(f"{server.url}/model_info", timeout=30).json()["max_context_length"]
    r = post(server.url, {"input_ids": [7] * ctx, "sampling_params": {"max_new_tokens": 1}})
    theirs = fixture("error_too_long")["body"]["error"]["message"]  # recorded with a 128-token context
    n = len(fixture("error_too_long")["request"]["body"]["input_ids"])
    assert r.status_code == 400 and r.json()["error"]["message"] == theirs.replace(str(n), str(ctx))


def test_model_info_has_sglangs_fields(server: Any) -> None:
    info = httpx.get(f"{server.url}/model_info", timeout=30).json()
    assert info["is_generation"] is True and info["architectures"] == ["Qwen3ForCausalLM"]
    assert info["model_type"] == "qwen3"
    sglang = fixture("model_info")["body"]
    missing = set(sglang) - set(info) - {"embedding"}  # embedding models' plan: not a generation server's
    assert not missing


def test_top_k_0_at_temperature_0_is_greedy_and_refused_when_sampling_as_in_sglang(
    server: Any, greedy: Any
) -> None:
    """SGLang 0.5.23 (`SamplingParams.__post_init__`) sets top_k to 1 when the temperature is under 1e-6,
    so `top_k: 0` (or any top_k) is a greedy request then; at a sampling temperature its `verify` refuses
    a top_k that is neither -1 nor at least 1, in these words."""
    for top_k in (0, -5):
        r = post(
            server.url,
            {"input_ids": USER, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "top_k": top_k}},
        )
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == greedy(USER, 6)
    r = post(
        server.url,
        {"input_ids": USER, "sampling_params": {"max_new_tokens": 6, "temperature": 0.7, "top_k": 0}},
    )
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "top_k must be -1 (disable) or at least 1, got 0."


def test_get_server_info_is_sglangs_configuration_with_its_field_names_and_types(server: Any) -> None:
    """/get_server_info (SGLang's deprecated alias of its /server_info) answers with SGLang's own field
    names, each with the JSON type SGLang's recorded reply has, and values true of this engine."""
    r = httpx.get(f"{server.url}/get_server_info", timeout=30)
    assert r.status_code == 200, r.text
    ours, theirs = r.json(), fixture("get_server_info")["body"]
    for mine, sglang in ((ours, theirs), (ours["internal_states"][0], theirs["internal_states"][0])):
        assert set(mine) <= set(sglang), set(mine) - set(sglang)
        for key, value in mine.items():
            if sglang[key] is not None:
                assert type(value) is type(sglang[key]), (key, value, sglang[key])
    ctx = httpx.get(f"{server.url}/model_info", timeout=30).json()["max_context_length"]
    assert (ours["context_length"], ours["max_req_input_len"]) == (ctx, ctx - 1)
    assert ours["max_total_num_tokens"] == 16 * ctx  # --max-running-requests 16 (conftest), each up to ctx
    assert (ours["tp_size"], ours["dp_size"], ours["device"], ours["version"]) == (1, 1, "cpu", "0.5.23")
    assert "api_key" not in ours  # SGLang echoes its key here; gyre-engine never echoes its token


def test_get_weights_by_name_reads_a_parameter_as_sglang_does(server: Any, hf_model: Any) -> None:
    """SGLang's reading: the parameter in float32, the first `truncate_size` entries of its first
    dimension as nested lists (default 100); GET or POST; a tied parameter under either name; a name the
    model does not have is SGLang's 400 "Get parameter by name failed"."""
    sd = {k: v.float() for k, v in hf_model.state_dict().items()}
    url = f"{server.url}/get_weights_by_name"
    q = "model.layers.0.self_attn.q_proj.weight"
    got = httpx.post(url, json={"name": q}, timeout=30)
    assert got.status_code == 200, got.text
    assert got.json() == sd[q][:100].tolist()
    got = httpx.request("GET", url, json={"name": q, "truncate_size": 3}, timeout=30).json()
    assert got == sd[q][:3].tolist()
    norm = "model.norm.weight"
    assert (
        httpx.post(url, json={"name": norm, "truncate_size": -60}, timeout=30).json()
        == sd[norm][:-60].tolist()
    )
    assert (
        httpx.post(url, json={"name": norm, "truncate_size": 2**70}, timeout=30).json() == sd[norm].tolist()
    )
    head = httpx.post(url, json={"name": "lm_head.weight", "truncate_size": 2}, timeout=30).json()
    embed = httpx.post(url, json={"name": "model.embed_tokens.weight", "truncate_size": 2}, timeout=30).json()
    assert head == embed == sd["model.embed_tokens.weight"][:2].tolist()  # tied in the tiny model
    r = httpx.post(url, json={"name": "no.such.weight"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("Get parameter by name failed")


@pytest.mark.parametrize("content_type", [None, "application/json"])
def test_an_empty_body_is_an_empty_object_on_every_endpoint_whose_fields_have_defaults(
    server: Any, content_type: str | None
) -> None:
    """A control call without a body is taken as `{}` (every field at its default), each pair leaving
    the engine as it found it. (SGLang's FastAPI routes answer 400 "Field required" to an empty body and
    take `{}`; gyre-engine takes both.)"""
    headers = {"content-type": content_type} if content_type else {}
    for path in (
        "/pause_generation",
        "/continue_generation",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/begin_weight_update",
        "/end_weight_update",
        "/abort_request",
        "/flush_cache",
    ):
        r = httpx.post(f"{server.url}{path}", content=b"", headers=headers, timeout=60)
        assert r.status_code == 200, (path, r.status_code, r.text)


def _meta_keys(evs: list[dict[str, Any]]) -> list[set[str]]:
    return [set(e["meta_info"]) for e in evs]


def test_a_stream_carries_the_fields_sglang_sends_where_it_sends_them(server: Any) -> None:
    body = {
        "input_ids": USER,
        "sampling_params": {"max_new_tokens": 5, "temperature": 0},
        "return_logprob": True,
    }
    ours = stream(server.url, body)
    theirs = [e for e in events("stream_default") if isinstance(e, dict)]
    assert all("e2e_latency" not in k and "weight_versions" not in k for k in _meta_keys(ours[:-1]))
    assert {"e2e_latency", "weight_versions"} <= _meta_keys(ours)[-1]
    assert ours[-1]["meta_info"]["weight_versions"] == [
        {"version": ours[-1]["meta_info"]["weight_version"], "start": 0, "end": 5}
    ]
    # no key SGLang would not send in that place
    assert all(k <= _meta_keys(theirs)[1] for k in _meta_keys(ours[:-1]))
    assert _meta_keys(ours)[-1] <= _meta_keys(theirs)[-1]


def test_stream_interval_follows_sglangs_rule(server: Any) -> None:
    sp = {"max_new_tokens": 11, "stream_interval": 4, "temperature": 0, "ignore_eos": True}
    ours = stream(server.url, {"input_ids": USER, "sampling_params": sp})
    theirs = [e for e in events("stream_interval") if isinstance(e, dict)]
    assert [len(e["output_ids"]) for e in ours] == [len(e["output_ids"]) for e in theirs] == [1, 5, 9, 11]


def test_a_chunk_is_held_back_while_its_tail_could_start_a_stop_string(server: Any, tokenizer: Any) -> None:
    """SGLang never sends text it may cut later, so cumulative text only grows; the finished chunk's
    text is cut before the stop string while its tokens stay in output_ids."""
    free = post(server.url, {"input_ids": USER, "sampling_params": {"max_new_tokens": 16, "temperature": 0}})
    out = free.json()["output_ids"]
    k = next(
        i
        for i in range(3, 14)
        if tokenizer.decode(out[i : i + 2]).strip()
        and tokenizer.decode(out[i : i + 2]) not in tokenizer.decode(out[: i + 1])
    )
    stop = tokenizer.decode(out[k : k + 2])
    sp = {"max_new_tokens": 16, "temperature": 0, "stop": [stop]}
    chunks = stream(server.url, {"input_ids": USER, "sampling_params": sp})
    final = chunks[-1]
    assert final["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in final["text"]
    assert all(final["text"].startswith(c["text"]) for c in chunks)
    assert final["output_ids"][: k + 2] == out[: k + 2]
