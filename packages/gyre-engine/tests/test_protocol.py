"""Wire records: the closed sampling-key set, round trips, and SGLang-shaped responses decode."""

from __future__ import annotations

import msgspec
import pytest
from gyre_engine.protocol import (
    KV_PREFIX_DECODER,
    KV_PREFIX_ENCODER,
    PROTOCOL_VERSION,
    SAMPLING_KEYS,
    GenerateResponse,
    KvPrefix,
    ProtocolError,
    SamplingParams,
    check_sampling_keys,
)
from hypothesis import given
from hypothesis import strategies as st


def test_sampling_keys_match_the_record_fields() -> None:
    assert set(SAMPLING_KEYS) == set(SamplingParams.__struct_fields__)


def test_unknown_sampling_key_is_named_like_sglang() -> None:
    with pytest.raises(ProtocolError, match=r"unknown field `bogus_key`, expected one of `max_new_tokens`"):
        check_sampling_keys({"temperature": 0.5, "bogus_key": 1})
    check_sampling_keys({k: None for k in SAMPLING_KEYS})


def test_client_side_params_encode_only_what_was_set() -> None:
    sp = SamplingParams(max_new_tokens=5, temperature=0.0)
    assert msgspec.to_builtins(sp) == {"max_new_tokens": 5, "temperature": 0.0}
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"bogus_key": 1}, SamplingParams)


def test_a_real_sglang_response_decodes() -> None:
    body = (
        b'{"text": "hi", "output_ids": [5, 151645], "meta_info": {"id": "r1", "finish_reason": {"type": "stop",'
        b' "matched": 151645}, "prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 1,'
        b' "weight_version": "default", "e2e_latency": 0.1, "spec_verify_ct": 0,'
        b' "output_token_logprobs": [[-0.5, 5, null], [-0.1, 151645, null]]}}'
    )
    r = msgspec.json.decode(body, type=GenerateResponse)
    assert r.meta_info.finish_reason is not None and r.meta_info.finish_reason.matched == 151645
    assert r.meta_info.output_token_logprobs == [(-0.5, 5, None), (-0.1, 151645, None)]


@given(
    ids=st.lists(st.integers(0, 1 << 20), max_size=50),
    layers=st.integers(0, 4),
    blob=st.binary(max_size=64),
)
def test_kv_prefix_round_trips(ids: list[int], layers: int, blob: bytes) -> None:
    rec = KvPrefix(
        PROTOCOL_VERSION, "fp", "3", ids, "bfloat16", (2, len(ids), 4), [blob] * layers, [blob[::-1]] * layers
    )
    assert KV_PREFIX_DECODER.decode(KV_PREFIX_ENCODER.encode(rec)) == rec


def test_xfer_records_round_trip_and_pass_the_offer_through_untouched() -> None:
    from gyre_engine.protocol import ImportPrefixXferRequest, PrefixOffer, UpdateFromXferRequest

    raw = (
        b'["kv_offer","r1",[1,"127.0.0.1:1","x",[[0,64,140000000000000,""]],[[0,0],[0,32]],1,1,32,1],[0],3,1]'
    )
    offer = PrefixOffer("o1", "fp", "0", [1, 2, 3], "float32", 2, 4, 16, 60.0, msgspec.Raw(raw))
    body = msgspec.json.encode({"offer": offer, "timeout_s": 5.0})
    back = msgspec.json.decode(body, type=ImportPrefixXferRequest)
    assert bytes(back.offer.kv_offer) == raw and back.offer.token_ids == [1, 2, 3]
    req = msgspec.json.decode(b'{"publisher": "tcp://127.0.0.1:5"}', type=UpdateFromXferRequest)
    assert (req.transport, req.min_version, req.weight_version) == ("shm", 0, None)  # needs no Mooncake
    for bad in (b'{"publisher": "p", "transport": "nccl"}', b'{"publisher": "p", "bogus": 1}'):
        with pytest.raises(msgspec.ValidationError):
            msgspec.json.decode(bad, type=UpdateFromXferRequest)
