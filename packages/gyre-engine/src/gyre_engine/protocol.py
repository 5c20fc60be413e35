"""Wire records of SGLang's native HTTP protocol, as gyre-engine serves it and the client speaks it.

Field names, defaults and shapes follow SGLang 0.5.23 (`GenerateReqInput`, `SamplingParams`, the control
request bodies); the set of `sampling_params` keys is closed, and `check_sampling_keys` names an unknown
key the way SGLang does. `KvPrefix` is gyre's own record for handing a cached prefix (KV arrays plus the
token ids they cover) from one engine to another; it carries a protocol version and encodes to msgpack.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

PROTOCOL_VERSION = 1

# Every key SGLang's SamplingParams accepts, in its order; anything else is HTTP 400.
SAMPLING_KEYS: tuple[str, ...] = (
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "choice",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
    "custom_params",
    "beam_width",
    "watermark",
)


class ProtocolError(ValueError):
    """A request that breaks the protocol; the server answers it with HTTP 400."""


def check_sampling_keys(params: dict[str, Any]) -> None:
    """Raise ProtocolError naming the first key SGLang would not accept."""
    for key in params:
        if key not in SAMPLING_KEYS:
            expected = ", ".join(f"`{k}`" for k in SAMPLING_KEYS)
            raise ProtocolError(f"unknown field `{key}`, expected one of {expected}")


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """SGLang's sampling parameters (defaults as SGLang's); `None` means 'not set'."""

    max_new_tokens: int = 128
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    n: int = 1
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    choice: list[str] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stream_interval: int | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None
    custom_params: dict[str, Any] | None = None
    beam_width: int | None = None
    watermark: dict[str, Any] | None = None


class GenerateRequest(msgspec.Struct, omit_defaults=True):
    """Body of POST /generate (one request; SGLang's list form is accepted by the server too)."""

    input_ids: list[int | list[int]] | None = None
    text: str | list[str] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    stream: bool = False


# One logprob entry, positional as SGLang sends it: [logprob, token_id, text or null].
LogprobEntry = tuple[float, int, str | None]


class FinishReason(msgspec.Struct, frozen=True, omit_defaults=True):
    """`{"type": "stop", "matched": ...}`, `{"type": "length", "length": N}` or an abort with its message."""

    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None
    err_type: str | None = None


class MetaInfo(msgspec.Struct, frozen=True, omit_defaults=True):
    """`meta_info` of a /generate response; extra keys from a real SGLang are ignored when decoding."""

    id: str
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    weight_version: str
    e2e_latency: float
    output_token_logprobs: list[LogprobEntry] | None = None
    output_top_logprobs: list[list[LogprobEntry] | None] | None = None


class GenerateResponse(msgspec.Struct, frozen=True):
    """One /generate response (or one cumulative streaming chunk)."""

    text: str
    output_ids: list[int]
    meta_info: MetaInfo


class SuccessReply(msgspec.Struct, frozen=True, omit_defaults=True):
    """`{"success", "message"}` of the weight-update endpoints."""

    success: bool
    message: str = ""
    num_paused_requests: int | None = None


class StatusReply(msgspec.Struct, frozen=True):
    """`{"message", "status"}` of pause/continue."""

    message: str
    status: str = "ok"


class ModelInfo(msgspec.Struct, frozen=True, omit_defaults=True):
    """GET /model_info."""

    model_path: str
    weight_version: str = "default"
    is_generation: bool = True
    served_model_name: str | None = None
    tokenizer_path: str | None = None
    max_context_length: int | None = None
    device: str | None = None
    dtype: str | None = None


class ServerInfo(msgspec.Struct, frozen=True):
    """GET /server_info (gyre-engine's counters; SGLang's /get_server_info carries other fields)."""

    weight_version: str
    running_requests: int
    waiting_requests: int
    paused: bool
    released: list[str]
    prefill_tokens_computed: int
    prefill_tokens_cached: int
    decode_steps: int
    decode_tokens: int
    cached_prefix_tokens: int


class ErrorBody(msgspec.Struct, frozen=True, omit_defaults=True):
    """The `error` object of an error reply: `{"error": {"message", "type", "code", "retryable"}}`."""

    message: str
    type: str = "BadRequestError"
    code: int = 400
    retryable: bool = False


class ErrorReply(msgspec.Struct, frozen=True):
    error: ErrorBody


class PauseRequest(msgspec.Struct, frozen=True):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueRequest(msgspec.Struct, frozen=True):
    torch_empty_cache: bool = False


class MemoryRequest(msgspec.Struct, frozen=True):
    tags: list[str] | None = None


class AbortRequest(msgspec.Struct, frozen=True):
    rid: str = ""
    abort_all: bool = False


class UpdateFromTensorRequest(msgspec.Struct, frozen=True):
    """Same-host tensors. gyre-engine reads `load_format="safetensors"`: each entry of
    `serialized_named_tensors` is base64 of a safetensors file (never a pickle); SGLang reads pickles."""

    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class UpdateFromDiskRequest(msgspec.Struct, frozen=True):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


class BeginWeightUpdateRequest(msgspec.Struct, frozen=True):
    selector: str | None = None


class KvPrefix(msgspec.Struct, frozen=True, tag="kv_prefix", array_like=True):
    """A cached prefix handed between engines: `token_ids` and, per layer, key and value blocks of shape
    `shape` (`[kv_heads, len(token_ids), head_dim]`) as raw little-endian bytes of `dtype` (a torch dtype
    name; bfloat16 travels as its 2-byte pattern). Produced and consumed only by engines of one model."""

    version: int
    model_fingerprint: str
    weight_version: str
    token_ids: list[int]
    dtype: str
    shape: tuple[int, int, int]
    keys: list[bytes]
    values: list[bytes]


KV_PREFIX_ENCODER = msgspec.msgpack.Encoder()
KV_PREFIX_DECODER = msgspec.msgpack.Decoder(KvPrefix)
