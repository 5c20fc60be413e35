"""Wire records of SGLang's native HTTP protocol, as gyre-engine serves it and the client speaks it.

Field names, defaults and shapes follow SGLang 0.5.23 (`GenerateReqInput`, `SamplingParams`, the control
request bodies); the set of `sampling_params` keys is closed, and `check_sampling_keys` names an unknown
key the way SGLang does. `KvPrefix` is gyre's own record for handing a cached prefix (KV arrays plus the
token ids they cover) from one engine to another; it carries a protocol version and encodes to msgpack.
The gyre-xfer records at the end (weight snapshots, prefix offers) carry gyre-xfer's own messages as raw
JSON, and a prefix offer over CUDA IPC carries torch's sharing arguments as plain values (`CudaIpcTensor`),
so this module and the client need neither gyre-xfer nor torch. Every request body is a struct here,
decoded by the server and encoded by the client (`client.py`), so the two cannot drift apart; requests
omit their defaults on the wire, which are SGLang's where SGLang has the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

PROTOCOL_VERSION = 1

# Every key SGLang's SamplingParams accepts, in the order its error message lists them (recorded from
# sglang 0.5.23, tests/fixtures/sglang-0.5.23/error_unknown_sampling_key.json); anything else is HTTP 400.
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
    "choice",
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
    """SGLang's sampling parameters (defaults as SGLang's); `None` means 'not set'. `max_new_tokens=None`
    is SGLang's 'no limit': generation ends at a stop or at the context length. (`null` for any other key
    means its default; `sampling_params_from` applies that.)"""

    max_new_tokens: int | None = 128
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


def sampling_params_from(params: dict[str, Any]) -> SamplingParams:
    """SGLang's reading of a `sampling_params` object: unknown keys are refused (ProtocolError), `null`
    stands for the key's default (for `max_new_tokens`: no limit), the rest must have the right type."""
    check_sampling_keys(params)
    given = {k: v for k, v in params.items() if v is not None or k == "max_new_tokens"}
    try:
        return msgspec.convert(given, SamplingParams)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"sampling_params: {exc}") from exc


class GenerateRequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """Body of POST /generate (one request; SGLang's list form is accepted by the server too).

    As in SGLang, `null` means the default, and in a batch the logprob fields may be one value for all
    inputs or a list with one per input; `token_ids_logprob` is one list of ids for all, or one per input."""

    input_ids: list[int | list[int]] | None = None
    text: str | list[str] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = False
    logprob_start_len: int | list[int] | None = -1
    top_logprobs_num: int | list[int] | None = 0
    token_ids_logprob: list[int | list[int]] | None = None
    return_text_in_logprobs: bool | None = False
    stream: bool | None = False


# One logprob entry, positional as SGLang sends it: [logprob, token_id, text or null]. The sampled token's
# logprob is a number; rows of top / token-id logprobs may hold null (a non-finite value, as orjson writes
# it), as SGLang's own schema (`sglang.api.v1.LogprobEntry`) allows.
LogprobEntry = tuple[float, int, str | None]
RowEntry = tuple[float | None, int, str | None]


class FinishReason(msgspec.Struct, frozen=True, omit_defaults=True):
    """`{"type": "stop", "matched": ...}`, `{"type": "length", "length": N}` or an abort with its message.

    `matched` is what ended the request: a stop string, a stop token id, or (SGLang's `MatchedTokens`) a
    list of ids. `type` is kept as sent: SGLang's schema admits other finish objects besides these three."""

    type: str
    matched: int | str | list[int] | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None
    err_type: str | None = None


class WeightVersionSpan(msgspec.Struct, frozen=True):
    """Output tokens `[start, end)` were sampled with weights `version` (SGLang's `weight_versions`)."""

    version: str = ""
    start: int = 0
    end: int = 0


class MetaInfo(msgspec.Struct, frozen=True, omit_defaults=True):
    """`meta_info` of a /generate response or stream chunk, read as SGLang 0.5.23 sends it.

    Only `id` is always there. SGLang puts `e2e_latency` and `weight_versions` on the finished chunk only;
    `cached_tokens` and `weight_version` may be absent (SGLang's schema defaults: 0 and, for the label,
    the server's default "default"); every other key SGLang adds (`num_retractions`, `reasoning_tokens`,
    `input_token_logprobs`, `output_token_logprobs_length`, `cached_tokens_details`, `dp_rank`,
    `response_sent_to_client_ts`, ...) is ignored."""

    id: str = ""
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    weight_version: str = "default"
    e2e_latency: float | None = None
    output_token_logprobs: list[LogprobEntry] | None = None
    output_top_logprobs: list[list[RowEntry] | None] | None = None
    output_token_ids_logprobs: list[list[RowEntry] | None] | None = None
    """With `token_ids_logprob`: per output position, the logprobs of the requested ids, in their order."""
    weight_versions: list[WeightVersionSpan] | None = None


class GenerateResponse(msgspec.Struct, frozen=True):
    """One /generate response (or one cumulative streaming chunk); unknown keys (`index`, ...) ignored."""

    text: str = ""
    output_ids: list[int] = msgspec.field(default_factory=list)
    meta_info: MetaInfo = msgspec.field(default_factory=MetaInfo)


class SuccessReply(msgspec.Struct, frozen=True, omit_defaults=True):
    """`{"success", "message"}` of the weight-update endpoints."""

    success: bool
    message: str = ""
    num_paused_requests: int | None = None


class StatusReply(msgspec.Struct, frozen=True):
    """`{"message", "status"}` of pause/continue."""

    message: str
    status: str = "ok"


class ModelInfo(msgspec.Struct, frozen=True):
    """GET /model_info: SGLang 0.5.23's fields (other keys it sends, such as `embedding`, are ignored),
    then gyre-engine's own (`max_context_length`, `device`, `dtype`; absent from SGLang's reply)."""

    model_path: str
    served_model_name: str | None = None
    tokenizer_path: str | None = None
    is_generation: bool = True
    preferred_sampling_params: str | None = None
    weight_version: str = "default"
    load_format: str | None = None
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    disaggregation_mode: str | None = None
    has_image_understanding: bool = False
    has_audio_understanding: bool = False
    model_type: str | None = None
    architectures: list[str] | None = None
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
    open_prefix_offers: int = 0
    """KV prefix offers (/offer_prefix) not yet released or expired."""
    prefill_time_s: float = 0.0
    """Seconds the engine thread spent in prefill steps since start."""
    prefill_passes: int = 0
    """Prefill forward passes since start: a group of fresh prompts, the rests of prefix-cached prompts
    packed together, or one chunk of a chunked or long prefill each count one."""
    prefill_graph_passes: int = 0
    """Of those, packed passes replayed as a CUDA graph straight into the decode slots."""
    decode_time_s: float = 0.0
    """Seconds the engine thread spent decoding since start (graph captures on first use included)."""
    graph_captures: int = 0
    """CUDA graphs of the decode step captured since start, the decode slots' and the long slots' (one per
    batch bucket, length bucket and run length; a slot buffer that grows drops them all)."""
    graph_capture_s: float = 0.0
    """Seconds those captures took."""
    slot_grows: int = 0
    """Times the decode slots' KV buffer grew (doubling up to its bound, copying, dropping the graphs)."""
    device_allocated_bytes: int = 0
    """Bytes of the engine's tensors on its GPU now (torch.cuda.memory_allocated; 0 on the CPU)."""
    device_reserved_bytes: int = 0
    """Bytes its CUDA caching allocator holds now (tensors and free cached blocks: what other processes on
    the GPU cannot use)."""
    device_peak_reserved_bytes: int = 0
    """The most the allocator held since start."""
    cache_returns: int = 0
    """Times the engine gave its allocator's free cached blocks back to the driver after a prefill step
    (when they passed its bound)."""
    memory_evicted_tokens: int = 0
    """Prefix-cache tokens dropped (or moved to the host tier) to keep `--min-free-gib` of the GPU free."""
    host_cached_prefix_tokens: int = 0
    """Prefix-cache tokens in the host tier now (`--host-cached-tokens`)."""
    host_spilled_tokens: int = 0
    """Prefix-cache tokens copied to the host tier since start, instead of dropped."""
    host_hit_tokens: int = 0
    """Prefix tokens of the host tier's hits that calls started on since start (copied back, not
    computed)."""
    step_time_s: float = 0.0
    """Seconds the engine thread spent in its steps since start: admission (prefix lookups, long slots
    claimed), prefill, decode, and what goes with them (prefixes stored, copies to the host tier)."""
    command_time_s: float = 0.0
    """Seconds the engine thread spent on calls from the server's other threads since start (prefix
    offers and installs, weight updates, memory release and resume, counters read)."""
    waiting_s: dict[str, float] = msgspec.field(default_factory=dict)
    """Request-seconds spent waiting for admission during the engine's steps since start, by what held
    the requests: `rows` (every row taken), `prefill_budget` (the step's prefill budget spent),
    `chunked_prefill` (it is busy with another request), `long_slot` (every long slot busy),
    `long_memory` (the long slots not allocated for want of GPU memory), `behind` (earlier waiting
    requests go first: the chunked prefill is kept for one of them, or the idle long slots are)."""


SGLANG_VERSION = "0.5.23"
"""The SGLang release whose native protocol gyre-engine speaks (reported as `version` by /get_server_info)."""


class SGLangServerArgs(msgspec.Struct, frozen=True, kw_only=True):
    """The part of SGLang's server arguments gyre-engine can state truly, under SGLang's names and types
    (its /get_server_info carries about 550; the rest, which describe SGLang's own machinery, are left
    out, and so is `api_key`, which SGLang echoes and gyre never does)."""

    model_path: str
    tokenizer_path: str
    served_model_name: str
    skip_tokenizer_init: bool
    load_format: str = "auto"
    context_length: int
    is_embedding: bool = False
    dtype: str
    device: str
    max_running_requests: int
    tp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    page_size: int = 1
    weight_version: str
    """As SGLang's: the version the server started with (/model_info has the current one)."""


class SGLangInternalState(SGLangServerArgs, frozen=True, kw_only=True):
    """One data-parallel rank of `internal_states` (gyre-engine has one)."""

    world_size: int = 1
    effective_max_running_requests_per_dp: int


class SGLangServerInfo(SGLangServerArgs, frozen=True, kw_only=True):
    """GET /get_server_info: SGLang's deprecated alias of its /server_info (gyre-engine's /server_info is
    its own counters, `ServerInfo`), with the fields of `SGLangServerArgs` and these."""

    status: str = "ready"
    max_total_num_tokens: int
    """The most KV tokens the running requests can hold: max_running_requests x context length."""
    max_req_input_len: int
    """Context length - 1, as SGLang's."""
    internal_states: list[SGLangInternalState]
    version: str = SGLANG_VERSION
    """The SGLang protocol version spoken (SGLang's own release number in its reply)."""
    frontend: str = "gyre-engine"
    """Who answers ("python" or "rust" for SGLang's own servers)."""


class GetWeightsByNameRequest(msgspec.Struct, frozen=True):
    """Body of GET or POST /get_weights_by_name (SGLang's `GetWeightsByNameReqInput`; other keys are
    ignored, as SGLang does)."""

    name: str
    truncate_size: int = 100


class LoadSnapshot(msgspec.Struct, frozen=True):
    """One data-parallel rank in SGLang's GET /v1/loads (its `LoadSnapshot`; the optional sections
    `memory`, `queues`, ... are ignored). `total_prefill_uncached_tokens` and `decode_moments[0]`
    (decode steps) are cumulative: they grow while the engine computes."""

    dp_rank: int = 0
    timestamp: float = 0.0
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_used_tokens: int = 0
    num_total_tokens: int = 0
    max_total_num_tokens: int = 0
    max_running_requests: int = 0
    token_usage: float = 0.0
    gen_throughput: float = 0.0
    cache_hit_rate: float = 0.0
    utilization: float = 0.0
    total_prefill_uncached_tokens: int = 0
    total_prefill_busy_us: int = 0
    decode_moments: list[float] | None = None
    """Sums over decode steps: [steps, batch sizes, step us, squared sizes, size * us, tokens]."""


class Loads(msgspec.Struct, frozen=True):
    """GET /v1/loads of SGLang (load per data-parallel rank); gyre-engine serves one rank."""

    loads: list[LoadSnapshot] = msgspec.field(default_factory=list)
    version: str | None = None
    timestamp: str | None = None


class EngineCounters(msgspec.Struct, frozen=True):
    """An engine's cumulative work since it started, read the same way from gyre-engine (`/server_info`)
    and SGLang (`/v1/loads`, summed over its ranks): two readings say how it spent the time between them.
    `decode_tokens` is the sum of decode batch sizes over `decode_steps` steps; `prefill_s` is None where
    the server does not count it."""

    decode_steps: int
    decode_tokens: int
    decode_s: float
    prefill_tokens: int
    """Prompt tokens computed (not served from the prefix cache)."""
    prefill_s: float | None = None
    evicted_tokens: int | None = None
    """Cached prefix tokens dropped (or moved to the host tier) to keep GPU memory free (gyre-engine's
    `memory_evicted_tokens`)."""
    host_spilled_tokens: int | None = None
    """Cached prefix tokens copied to the host tier instead of dropped (gyre-engine's)."""
    host_hit_tokens: int | None = None
    """Prefix tokens served from the host tier: copied back, not computed (gyre-engine's)."""
    step_s: float | None = None
    """Seconds the engine thread spent in its steps (gyre-engine's `step_time_s`)."""
    command_s: float | None = None
    """Seconds the engine thread spent on calls from other threads (gyre-engine's `command_time_s`)."""
    waiting_s: dict[str, float] | None = None
    """Request-seconds spent waiting for admission, by what held the requests (gyre-engine's)."""
    graph_captures: int | None = None
    """Decode steps captured as CUDA graphs (gyre-engine's; a capture in the middle of decoding holds
    every running row for its seconds)."""
    graph_capture_s: float | None = None
    """Seconds those captures took (gyre-engine's)."""
    prefill_passes: int | None = None
    """Prefill forward passes (gyre-engine's: a group of fresh prompts, a packed pass of calls extending
    cached contexts, one chunk of a chunked or long prefill)."""
    prefill_graph_passes: int | None = None
    """Of those, packed passes replayed as a CUDA graph into the decode slots (gyre-engine's)."""


class EngineLoad(msgspec.Struct, frozen=True):
    """What an engine is doing now, read the same way from gyre-engine and SGLang (`EngineClient.load`).

    `work` is a counter that grows whenever the engine computes (prefill tokens plus decode steps), so two
    readings tell whether it computed in between. `source` says which endpoint it came from."""

    running: int
    waiting: int
    work: int
    weight_version: str
    source: Literal["gyre-engine", "sglang"]
    counters: EngineCounters | None = None


class ErrorBody(msgspec.Struct, frozen=True, omit_defaults=True):
    """The `error` object of an error reply: `{"error": {"message", "type", "code", "retryable"}}`."""

    message: str
    type: str = "BadRequestError"
    code: int = 400
    retryable: bool = False


class ErrorReply(msgspec.Struct, frozen=True):
    error: ErrorBody


PauseMode = Literal["abort", "retract", "in_place"]
Transport = Literal["mooncake", "shm"]
"""How gyre-engine moves weights and KV blocks through gyre-xfer: same-host shared memory (the default: it
needs no system library and opens no port) or Mooncake Transfer Engine (TCP here, RDMA where present;
across hosts)."""
PrefixTransport = Literal["mooncake", "shm", "cuda_ipc"]
"""How a prefix offer's KV moves: the gyre-xfer transports, or "cuda_ipc" (device to device between two
engines on one GPU, through torch's CUDA IPC; an engine off CUDA offers over shared memory instead, and
`client.handoff_prefix` falls back to shared memory when the importer is on another GPU)."""
WeightLayout = Literal["transformers", "megatron"]
"""Tensor names and layout of a weight snapshot: transformers', or Megatron-core GPT's (fused QKV and
gate/up), converted on the way in."""


class PauseRequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """Body of POST /pause_generation."""

    mode: PauseMode = "abort"


class ContinueRequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """Body of POST /continue_generation."""

    torch_empty_cache: bool = False


class MemoryRequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """Body of POST /release_memory_occupation and /resume_memory_occupation (`None`: all)."""

    tags: list[str] | None = None


class AbortRequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """Body of POST /abort_request: one request by `rid`, or every one."""

    rid: str = ""
    abort_all: bool = False


class UpdateFromTensorRequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """Same-host tensors. gyre-engine reads `load_format="safetensors"`: each entry of
    `serialized_named_tensors` is base64 of a safetensors file (never a pickle); SGLang reads pickles."""

    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class UpdateFromDiskRequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """Body of POST /update_weights_from_disk."""

    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


class BeginWeightUpdateRequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """Body of POST /begin_weight_update (/end_weight_update takes `{}`)."""

    selector: str | None = None


WEIGHT_GROUP_TIMEOUT_S = 300.0
"""gyre-engine's default deadline for forming a weight-update group and for each of its broadcasts."""


class InitWeightsUpdateGroupRequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """Body of POST /init_weights_update_group (SGLang's fields; `timeout_s` is gyre-engine's own, and
    SGLang ignores it)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"
    timeout_s: float = WEIGHT_GROUP_TIMEOUT_S
    """gyre-engine: deadline for forming the group and for each broadcast."""


class UpdateFromDistributedRequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """Body of POST /update_weights_from_distributed (SGLang's fields): rank 0 of the group then
    broadcasts each tensor in the order of `names`."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None


class DestroyWeightsUpdateGroupRequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """Body of POST /destroy_weights_update_group."""

    group_name: str = "weight_update_group"


class ExportPrefixRequest(msgspec.Struct, frozen=True):
    """Body of POST /export_prefix (gyre-engine only): the tokens whose longest cached prefix to export."""

    input_ids: list[int]


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


# ---- gyre-engine over gyre-xfer: weight snapshots and KV prefix hand-off (gyre-engine only) ----------

Seconds = Annotated[float, msgspec.Meta(gt=0, le=86400)]
"""A wait or lease a request may ask for: positive and at most a day (as `/init_weights_update_group`'s
`timeout_s`); anything else is refused with the body (400)."""


class UpdateFromXferRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Body of POST /update_weights_from_xfer: pull a gyre-xfer snapshot and load it between two steps."""

    publisher: str
    """The gyre-xfer publisher's control address (`Publisher.address`), e.g. tcp://127.0.0.1:5555."""
    min_version: int = 0
    """Load the newest published version >= this one (the publisher answers NO_VERSION otherwise)."""
    transport: Transport = "shm"
    """Same-host shared memory (the default) or Mooncake across hosts (`Transport`)."""
    timeout_s: Seconds = 120.0
    """Deadline for the bytes of the whole version."""
    control_timeout_s: Seconds = 10.0
    """Deadline for one control message to the publisher (lease, release)."""
    weight_version: str | None = None
    """The engine's new `weight_version`; default: the snapshot's version number."""
    layout: WeightLayout = "transformers"
    """The publisher's tensor names and layout: "megatron" (Megatron-core GPT: fused QKV, fused gate/up)
    is converted on the way in with gyre-xfer's `megatron_to_hf`."""
    flush_cache: bool = True
    abort_all_requests: bool = False


class XferWeightsReply(msgspec.Struct, frozen=True):
    success: bool
    message: str
    weight_version: str
    snapshot_version: int
    num_tensors: int
    nbytes: int
    pull_s: float
    apply_s: float
    """From the pulled snapshot checked to the update applied: waiting for the engine thread to end its
    step (`apply_wait_s` of it), then the copies into the parameters (and the cache flush)."""
    apply_wait_s: float = 0.0
    """The part of `apply_s` the update waited for the engine thread to take it (its step running)."""


class OfferPrefixRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Body of POST /offer_prefix: copy the cached prefix of `input_ids` into a registered KV pool."""

    input_ids: list[int]
    transport: PrefixTransport = "shm"
    """As in `UpdateFromXferRequest`: shared memory by default, Mooncake across hosts; "cuda_ipc" hands
    the importer a handle to a device copy of the KV (an engine on CUDA; others offer over shared memory)."""
    block_tokens: Annotated[int, msgspec.Meta(ge=1)] = 16
    """Tokens per KV block of the offered pool."""
    lease_s: Seconds = 120.0
    """The pool is freed after this long if no receipt (/release_prefix_offer) comes back first."""


CUDA_IPC_UNREACHABLE = "CudaIpcUnreachable"
"""The error type (HTTP 409) of an import refused because the offer is in another GPU's memory (or the
importer is not on a GPU): nothing was read; the offer can be released and made again another way."""

CUDA_IPC_REF_COUNTER_SLOTS = 10000
"""Reference counters in one of torch's CUDA IPC counter files (torch's CUDA_IPC_REF_COUNTER_FILE_SIZE):
a counter offset past it would make the importer write outside the file's mapping."""


class CudaIpcTensor(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A tensor in another process's CUDA memory, shared through torch's CUDA IPC: the plain values among
    the arguments of `torch.multiprocessing.reductions.rebuild_cuda_tensor`, as `reduce_tensor` gave them
    to the exporter (the tensor and storage classes are always `torch.Tensor` and `TypedStorage`, and
    `requires_grad` False, so they do not travel). Only a process whose device has the UUID
    `device_uuid` can open it; it passes its own index of that device to torch. Nothing is pickled."""

    device_uuid: str
    """`str(torch.cuda.get_device_properties(device).uuid)` of the exporter's GPU."""
    size: list[Annotated[int, msgspec.Meta(ge=0)]]
    stride: list[Annotated[int, msgspec.Meta(ge=0)]]
    tensor_offset: Annotated[int, msgspec.Meta(ge=0)]
    """Elements from the storage's start to the tensor's."""
    dtype: str
    """torch's name without the `torch.` prefix ("uint8")."""
    storage_handle: bytes
    """torch's IPC handle of the CUDA allocation that holds the storage (base64 in JSON)."""
    storage_size_bytes: Annotated[int, msgspec.Meta(ge=0)]
    storage_offset_bytes: Annotated[int, msgspec.Meta(ge=0)]
    """Where the storage starts in that allocation."""
    ref_counter_handle: Annotated[str, msgspec.Meta(pattern=r"^/torch_[A-Za-z0-9_]+$", max_length=200)]
    """The shared-memory file of torch's reference counter for this share, `/torch_<pid>_<random>_<n>`
    (the importer decrements it when it drops the tensor): a name in /dev/shm, never a path."""
    ref_counter_offset: Annotated[int, msgspec.Meta(ge=0, lt=CUDA_IPC_REF_COUNTER_SLOTS)]
    event_handle: bytes
    """An interprocess CUDA event recorded after the exporter's copies; the importer's stream waits on it
    when `event_sync_required` (torch synchronized the exporter's stream instead when it is False)."""
    event_sync_required: bool


class PrefixOffer(msgspec.Struct, frozen=True):
    """A prefix ready to be pulled: `token_ids` are covered by `kv_offer`'s blocks (`block_tokens` each,
    per layer K and V laid out `[block_tokens, kv_heads, head_dim]` of `dtype`). `kv_offer` is
    gyre-xfer's `KvOffer` as JSON, passed through untouched by the client (which needs no gyre-xfer).

    An offer over CUDA IPC has `cuda_ipc` instead (and `kv_offer` is JSON null): one flat uint8 buffer on
    the exporter's GPU holding, per layer, K then V as `[kv_heads, len(token_ids), head_dim]` of `dtype`,
    then the offer id (32 ASCII hex digits; zeroed when the offer is released). Its blocks, for the
    receipt, are `block_tokens` tokens each as above."""

    offer_id: str
    model_fingerprint: str
    weight_version: str
    token_ids: list[int]
    dtype: str
    kv_heads: int
    head_dim: int
    block_tokens: int
    lease_s: float
    kv_offer: msgspec.Raw
    cuda_ipc: CudaIpcTensor | None = None


class ImportPrefixXferRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Body of POST /import_prefix_xfer: pull an offer's blocks and install them in the prefix cache."""

    offer: PrefixOffer
    timeout_s: Seconds = 30.0
    """Deadline for the blocks' transfer; a dead or hung source is an error within it."""


class BlockReport(msgspec.Struct, frozen=True, array_like=True):
    """What happened to one block: `status` is OK, OUT_OF_RANGE, PEER_GONE, TIMEOUT, FAILED or NOT_ATTEMPTED."""

    src_block: int
    dst_block: int
    status: str


class PrefixImportReply(msgspec.Struct, frozen=True):
    success: bool
    message: str
    tokens: int
    blocks: list[BlockReport]
    nbytes: int
    elapsed_s: float
    transport: str = ""
    """The way the KV came: "cuda_ipc", "shm" or "mooncake" ("" from a server that does not say)."""


class ReleaseOfferRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Body of POST /release_prefix_offer (a receipt): the source frees the offer's pool."""

    offer_id: str
    arrived: list[int] = msgspec.field(default_factory=list)
    failed: list[int] = msgspec.field(default_factory=list)
