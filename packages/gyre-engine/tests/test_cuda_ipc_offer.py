"""The CUDA IPC prefix offer's protocol and refusals, on the CPU: the offer's description of a shared device
buffer (`CudaIpcTensor`, the plain values of torch's `rebuild_cuda_tensor` arguments) goes through JSON
as base64 and plain numbers, never a pickle, and decodes back exactly; descriptions torch could not use
safely are refused by the decoder; an importer off the exporter's GPU refuses the offer before opening
anything, and one whose buffer does not fit the prefix is refused as bad input. The device path itself
runs in `test_cuda_ipc_handoff_cuda.py`."""

from __future__ import annotations

import base64
import sys
from pathlib import Path

import msgspec
import pytest
import torch
from gyre_engine.protocol import (
    CUDA_IPC_UNREACHABLE,
    CudaIpcTensor,
    ImportPrefixXferRequest,
    OfferPrefixRequest,
)
from gyre_engine.server.cuda_ipc import CudaIpcUnreachable, expandable_segments, open_shared
from gyre_engine.server.errors import error_for
from gyre_engine.server.kv_transfer import KvTransferError
from gyre_engine.server.xfer import STAMP_BYTES, XferHub, offer_transport

sys.path.insert(0, str(Path(__file__).parent))  # the shared helpers (tests run with --import-mode=importlib)
from ipc_offers import described, offer_of

LAYERS, HEADS, DIM, TOKENS = 3, 2, 8, 21
PLANE = HEADS * TOKENS * DIM * 2  # bfloat16


def full_size() -> int:
    return 2 * LAYERS * PLANE + STAMP_BYTES


def test_the_offer_goes_through_json_as_plain_values_and_back_exactly() -> None:
    shared = described(full_size())
    offer = offer_of(shared, TOKENS, HEADS, DIM)
    wire = msgspec.json.encode(ImportPrefixXferRequest(offer))
    raw = msgspec.json.decode(wire)["offer"]["cuda_ipc"]
    # bytes travel as base64 strings, everything else as JSON numbers, strings and booleans
    assert base64.b64decode(raw["storage_handle"]) == shared.storage_handle
    assert base64.b64decode(raw["event_handle"]) == shared.event_handle
    assert raw["ref_counter_handle"].startswith("/torch_") and raw["event_sync_required"] is True
    assert all(isinstance(v, str | int | bool | list) for v in raw.values())
    back = msgspec.json.decode(wire, type=ImportPrefixXferRequest).offer
    assert back == offer and back.cuda_ipc == shared
    assert offer_transport(back) == "cuda_ipc"


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("ref_counter_handle", "/dev/shm/other", "matching regex"),
        ("ref_counter_handle", "/torch_1_2/../x", "matching regex"),
        ("ref_counter_offset", 10_000, "<"),  # past torch's counter file: a write outside its mapping
        ("ref_counter_offset", -1, ">="),
        ("storage_size_bytes", -5, ">="),
    ],
)
def test_descriptions_torch_could_not_use_safely_do_not_decode(field: str, value: object, why: str) -> None:
    raw = msgspec.json.decode(msgspec.json.encode(described(full_size())))
    raw[field] = value
    with pytest.raises(msgspec.ValidationError, match=why):
        msgspec.json.decode(msgspec.json.encode(raw), type=CudaIpcTensor)
    raw = msgspec.json.decode(msgspec.json.encode(described(full_size())))
    raw["pickled_class"] = "torch.Tensor"
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.json.decode(msgspec.json.encode(raw), type=CudaIpcTensor)


def test_an_importer_off_the_gpu_refuses_before_opening_anything() -> None:
    hub = XferHub()
    try:
        with pytest.raises(CudaIpcUnreachable, match="this engine is on cpu") as ei:
            hub.pull_prefix(
                offer_of(described(full_size()), TOKENS, HEADS, DIM), LAYERS, torch.device("cpu"), 5.0
            )
        reply = error_for(ei.value)
        assert reply.status_code == 409
        err = msgspec.json.decode(bytes(reply.body))["error"]
        assert err["type"] == CUDA_IPC_UNREACHABLE and "on cpu" in err["message"]
    finally:
        hub.close()


@pytest.mark.parametrize(
    "change",
    [
        {"size": [2 * LAYERS * PLANE]},  # no room for the offer id
        {"size": [full_size() + 2]},
        {"dtype": "bfloat16", "size": [full_size() // 2]},
        {"stride": [2]},
    ],
)
def test_a_buffer_that_does_not_fit_the_prefix_is_bad_input(change: dict[str, object]) -> None:
    hub = XferHub()
    try:
        with pytest.raises(KvTransferError, match="need uint8") as ei:
            hub.pull_prefix(
                offer_of(described(full_size(), **change), TOKENS, HEADS, DIM),
                LAYERS,
                torch.device("cpu"),
                5.0,
            )
        assert error_for(ei.value).status_code == 400
        with pytest.raises(KvTransferError, match="need uint8"):  # one layer more than the offer holds
            hub.pull_prefix(
                offer_of(described(full_size()), TOKENS, HEADS, DIM), LAYERS + 1, torch.device("cpu"), 5.0
            )
    finally:
        hub.close()


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"event_handle": b"\x01" * 8}, "malformed CUDA IPC handles"),  # torch reads 64 bytes from it
        ({"storage_handle": b"\x02\x00"}, "malformed CUDA IPC handles"),
        ({"storage_size_bytes": 2 * LAYERS * PLANE}, "runs past its storage"),
        ({"tensor_offset": 64}, "runs past its storage"),
        ({"stride": [1, 1]}, "differ in rank"),
    ],
)
def test_a_description_torch_could_not_open_safely_is_bad_input(change: dict[str, object], why: str) -> None:
    """Refused before the device is even looked at (here: the CPU), so before torch reads any handle."""
    hub = XferHub()
    try:
        shared = described(full_size(), **change)
        with pytest.raises(ValueError, match=why):
            open_shared(shared, torch.device("cpu"))
        if "stride" not in change:  # (a stride of another rank is already refused as not fitting)
            with pytest.raises(KvTransferError, match=f"cannot be opened safely: .*{why}") as ei:
                hub.pull_prefix(offer_of(shared, TOKENS, HEADS, DIM), LAYERS, torch.device("cpu"), 5.0)
            assert error_for(ei.value).status_code == 400
    finally:
        hub.close()


def test_an_offer_request_names_cuda_ipc_and_still_defaults_to_shared_memory() -> None:
    """(What an engine off CUDA does with "cuda_ipc", shared memory, is checked across processes in
    test_xfer_wiring.py.)"""
    body = msgspec.json.decode(b'{"input_ids": [1, 2], "transport": "cuda_ipc"}', type=OfferPrefixRequest)
    assert body.transport == "cuda_ipc"
    with pytest.raises(msgspec.ValidationError, match="Invalid enum value 'nvlink'"):
        msgspec.json.decode(b'{"input_ids": [1], "transport": "nvlink"}', type=OfferPrefixRequest)
    assert msgspec.json.decode(b'{"input_ids": [1]}', type=OfferPrefixRequest).transport == "shm"


@pytest.mark.parametrize(
    ("settings", "on"),
    [
        ("expandable_segments:True", True),
        ("max_split_size_mb:128, expandable_segments:true", True),
        ("expandable_segments:False", False),
        ("", False),
    ],
)
def test_expandable_segments_are_read_from_the_allocator_settings(settings: str, on: bool) -> None:
    assert expandable_segments(settings) is on
