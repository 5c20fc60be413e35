"""The client's parsers against what SGLang 0.5.23 really sends (fixtures recorded from sglang's own HTTP
layer by scripts/sglang_fixtures.py): every recorded reply decodes, and through a real HTTP server that
replays them byte for byte, `EngineClient` streams, generates, reads errors, model info and load as sent."""

from __future__ import annotations

import asyncio
import itertools
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
from gyre_engine.client import EngineClient, EngineError, error_from, stream_error
from gyre_engine.protocol import SAMPLING_KEYS, GenerateResponse, Loads, ModelInfo, ServerInfo

sys.path.insert(0, str(Path(__file__).parent))  # the shared helpers (tests run with --import-mode=importlib)
from sglang_shapes import ReplayServer, all_fixtures, events, fixture, manifest

GEN = msgspec.json.Decoder(GenerateResponse)
EOS = 2  # <|im_end|> of gyre's tiny tokenizer, what the recorded stand-in ends its text with


def chunks(name: str) -> list[GenerateResponse]:
    return [msgspec.convert(e, GenerateResponse) for e in events(name) if isinstance(e, dict)]


@pytest.fixture(scope="module")
def replay() -> Any:
    srv = ReplayServer()
    yield srv
    srv.stop()


def test_the_fixtures_come_from_sglang_0_5_23() -> None:
    m = manifest()
    assert m["sglang"] == "0.5.23"
    assert set(m["cases"]) <= {f["case"] for f in all_fixtures()}


@pytest.mark.parametrize("fx", all_fixtures(), ids=lambda f: f["case"])
def test_every_recorded_generate_reply_decodes(fx: dict[str, Any]) -> None:
    if fx["request"]["path"] != "/generate":
        return
    raw = msgspec.json.encode(fx["body"])
    if fx["status"] >= 400:
        err = error_from(fx["status"], raw)
        assert err.status == fx["status"] and err.message and not err.retryable
        return
    if "events" in fx:
        for ev in fx["events"][:-1]:
            data = msgspec.json.encode(ev)
            err = stream_error(data)
            if err is None:
                GEN.decode(data)
            else:
                assert err.status == ev["error"]["code"] and err.message == ev["error"]["message"]
        assert fx["events"][-1] == "[DONE]"
    elif isinstance(fx["body"], list):
        msgspec.json.decode(raw, type=list[GenerateResponse])
    else:
        GEN.decode(raw)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("unauthorized_no_key", "Unauthorized"),
        ("unauthorized_wrong_key", "Unauthorized"),
        ("unauthorized_control", "Unauthorized"),
        ("unknown_route", "Not Found"),
        ("wrong_method_generate", "Method Not Allowed"),
        ("error_malformed_json", "JSON decode error"),
    ],
)
def test_key_and_routing_errors_read_as_sglang_sends_them(name: str, message: str) -> None:
    """SGLang's 401 (`{"error": "Unauthorized"}`), FastAPI's 404/405 (`{"detail": ...}`) and validation
    error (`{"object": "error", "message"}`) each become an EngineError with the message itself."""
    fx = fixture(name)
    err = error_from(fx["status"], msgspec.json.encode(fx["body"]))
    assert err.status == fx["status"] and message in err.message and not err.retryable
    assert not err.message.startswith("{")


def test_a_default_stream_is_cumulative_with_e2e_latency_only_on_the_finished_chunk() -> None:
    cs = chunks("stream_default")
    assert len(cs) > 5
    for prev, cur in itertools.pairwise(cs):
        assert cur.output_ids[: len(prev.output_ids)] == prev.output_ids
        assert len(cur.output_ids) == len(prev.output_ids) + 1
    for c in cs:
        lps = c.meta_info.output_token_logprobs
        assert lps is not None and [t for _, t, _ in lps] == c.output_ids
    assert all(c.meta_info.e2e_latency is None and c.meta_info.finish_reason is None for c in cs[:-1])
    last = cs[-1].meta_info
    assert last.e2e_latency is not None and last.e2e_latency > 0
    assert last.finish_reason is not None and (last.finish_reason.type, last.finish_reason.matched) == (
        "stop",
        EOS,
    )
    assert cs[-1].output_ids[-1] == EOS  # the stop token stays in output_ids
    assert last.weight_versions is not None and last.weight_versions[0].end == len(cs[-1].output_ids)
    assert all(c.meta_info.weight_versions is None for c in cs[:-1])


def test_stream_interval_sends_the_first_token_then_every_k() -> None:
    assert [len(c.output_ids) for c in chunks("stream_interval")] == [1, 5, 9, 11]
    fin = chunks("stream_interval")[-1].meta_info.finish_reason
    assert fin is not None and (fin.type, fin.length) == ("length", 11)


def test_a_stop_string_holds_chunks_back_and_is_cut_from_the_text_only() -> None:
    cs = chunks("stream_stop_string")
    fin = cs[-1].meta_info.finish_reason
    assert fin is not None and (fin.type, fin.matched) == ("stop", "thanks")
    assert not cs[-1].text.endswith("thanks") and "thanks" not in cs[-1].text
    sizes = [len(c.output_ids) for c in cs]
    assert sizes[-1] - sizes[-2] > 1  # the tokens that could begin "thanks" were held back
    tail = fixture("stream_stop_string_no_trim")["events"][-2]
    assert tail["text"].endswith("Goodbye") and tail["meta_info"]["finish_reason"]["matched"] == "Goodbye"


def test_an_aborted_stream_ends_with_an_abort_finish() -> None:
    cs = chunks("stream_abort")
    fin = cs[-1].meta_info.finish_reason
    assert fin is not None and fin.type == "abort" and fin.message == "Aborted"
    assert cs[-1].meta_info.e2e_latency is not None


def test_token_ids_logprob_and_top_logprobs_rows() -> None:
    r = msgspec.convert(fixture("generate_token_ids_logprob")["body"], GenerateResponse)
    rows = r.meta_info.output_token_ids_logprobs
    assert rows is not None and len(rows) == len(r.output_ids)
    assert all(row is not None and [t for _, t, _ in row] == [5, 9, 553] for row in rows)
    r = msgspec.convert(fixture("generate_logprobs")["body"], GenerateResponse)
    tops = r.meta_info.output_top_logprobs
    assert tops is not None and all(row is not None and len(row) == 2 for row in tops)
    lps = r.meta_info.output_token_logprobs
    assert lps is not None and all(isinstance(text, str) for _, _, text in lps)  # return_text_in_logprobs


def test_finish_matched_reads_a_string_an_int_or_a_list_of_ids() -> None:
    body = fixture("generate_stop_token_id")["body"]
    r = msgspec.convert(body, GenerateResponse)
    assert r.meta_info.finish_reason is not None and r.meta_info.finish_reason.matched == 28
    # SGLang's schema (`Matched = int | str | MatchedTokens`) also allows a list of ids: the same reply
    # with that arm decodes too
    body["meta_info"]["finish_reason"]["matched"] = [28, 29]
    r = msgspec.convert(body, GenerateResponse)
    assert r.meta_info.finish_reason is not None and r.meta_info.finish_reason.matched == [28, 29]


def test_optional_fields_take_sglangs_defaults() -> None:
    body = fixture("generate_text")["body"]
    for key in ("cached_tokens", "weight_version", "e2e_latency", "completion_tokens", "finish_reason"):
        body["meta_info"].pop(key)
    r = msgspec.convert(body, GenerateResponse)
    assert (r.meta_info.cached_tokens, r.meta_info.weight_version, r.meta_info.e2e_latency) == (
        0,
        "default",
        None,
    )


def test_sampling_keys_are_sglangs_in_its_order() -> None:
    msg = fixture("error_unknown_sampling_key")["body"]["error"]
    listed = [k.strip("`") for k in msg.split("expected one of ")[1].split(", ")]
    assert tuple(listed) == SAMPLING_KEYS


def test_model_info_loads_and_server_info_decode() -> None:
    info = msgspec.convert(fixture("model_info")["body"], ModelInfo)
    assert (
        info.is_generation and info.architectures == ["Qwen3ForCausalLM"] and info.weight_version == "default"
    )
    loads = msgspec.convert(fixture("loads_busy")["body"], Loads)
    assert loads.loads[0].num_running_reqs == 1
    with pytest.raises(msgspec.ValidationError):  # SGLang's /server_info is its configuration, not counters
        msgspec.convert(fixture("server_info")["body"], ServerInfo)


def test_the_client_over_http_reads_what_sglang_sent(replay: ReplayServer) -> None:
    async def go() -> None:
        async with EngineClient(replay.url, timeout_s=30) as c:
            got = [ch async for ch in c.stream([1], rid="stream_default")]
            assert got == chunks("stream_default")
            got = [ch async for ch in c.stream([1], rid="stream_stop_string")]
            assert got == chunks("stream_stop_string")
            with pytest.raises(EngineError) as err:
                _ = [ch async for ch in c.stream([1], rid="stream_error_too_long")]
            assert err.value.status == 400 and "longer than the model's context length" in err.value.message
            assert not err.value.retryable
            r = await c.generate([1], rid="generate_logprobs", return_logprob=True)
            assert r == msgspec.convert(fixture("generate_logprobs")["body"], GenerateResponse)
            for name, needle in (
                ("error_unknown_sampling_key", "unknown field `bogus_key`"),
                ("error_too_long", "longer than the model's context length"),
                ("error_bad_temperature", "temperature must be a non-negative finite number"),
            ):
                with pytest.raises(EngineError, match=needle) as err:
                    await c.generate([1], rid=name)
                assert err.value.status == 400
            assert (await c.model_info()).architectures == ["Qwen3ForCausalLM"]
            for path in ("update_distributed_outside_session", "end_weight_update_without_begin"):
                with pytest.raises(EngineError, match="begin_weight_update") as err:
                    await c._post(f"/{path}")
                assert err.value.status == 400
            load = await c.load()  # /server_info is SGLang's: the load comes from /v1/loads
            assert (load.source, load.running, load.waiting, load.weight_version) == (
                "sglang",
                0,
                0,
                "default",
            )
            replay.names["loads"] = "loads_busy"
            busy = await c.load()
            assert busy.running == 1 and busy.work > load.work
            assert await c.health() and await c.ready()

    asyncio.run(go())
