"""Typed async client for SGLang's native HTTP protocol; works against SGLang and gyre-engine alike.

Every request body is the request struct of `protocol.py` that the server decodes (sampling parameters
are a closed `SamplingParams` record; structs are encoded without their defaults, which are SGLang's), so
it sends only keys SGLang accepts. Responses are parsed into the records of `protocol.py`, which read what SGLang 0.5.23
sends (tested against fixtures recorded from sglang's own HTTP layer, `tests/fixtures/sglang-0.5.23`).
Every call has a timeout; an HTTP error, or an error event inside a stream, becomes `EngineError` with
the server's message, status and whether a retry may help, whichever of SGLang's error shapes it came in.
Every request carries the run token as `Authorization: Bearer <token>` when there is one (the `api_key`
argument, else `$GYRE_TOKEN`: `gyre_base.token`), which is what gyre-engine beyond loopback and SGLang
started with `--api-key` both check. Health probes and aborts each have a small connection pool of their
own, apart from the one generation and weight updates use, so a load that fills that pool (or requests
that hang there) cannot keep an engine from being seen healthy again or told to stop a request.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import ssl
from collections.abc import AsyncIterator, Mapping
from types import TracebackType
from typing import Any, TypeVar, cast

import httpx
import msgspec
from gyre_base.token import bearer, resolve_token

from gyre_engine.protocol import (
    CUDA_IPC_UNREACHABLE,
    KV_PREFIX_DECODER,
    KV_PREFIX_ENCODER,
    AbortRequest,
    ContinueRequest,
    DestroyWeightsUpdateGroupRequest,
    EngineCounters,
    EngineLoad,
    ExportPrefixRequest,
    GenerateRequest,
    GenerateResponse,
    ImportPrefixXferRequest,
    InitWeightsUpdateGroupRequest,
    KvPrefix,
    Loads,
    MemoryRequest,
    ModelInfo,
    OfferPrefixRequest,
    PauseMode,
    PauseRequest,
    PrefixImportReply,
    PrefixOffer,
    PrefixTransport,
    ReleaseOfferRequest,
    SamplingParams,
    ServerInfo,
    StatusReply,
    SuccessReply,
    Transport,
    UpdateFromDiskRequest,
    UpdateFromDistributedRequest,
    UpdateFromTensorRequest,
    UpdateFromXferRequest,
    WeightLayout,
    XferWeightsReply,
)
from gyre_engine.sse import data_fields

T = TypeVar("T")
_enc = msgspec.json.Encoder()
_gen_dec = msgspec.json.Decoder(GenerateResponse)
_gen_list_dec = msgspec.json.Decoder(list[GenerateResponse])


class EngineError(RuntimeError):
    """An error reply from the server (or a stream that reported one in-band)."""

    def __init__(self, status: int, message: str, retryable: bool = False, err_type: str = "") -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.retryable = retryable
        self.err_type = err_type
        """The body's error `type` where it has one (gyre-engine's and SGLang's refusals), else ""."""


def error_from(status: int, body: bytes) -> EngineError:
    """The error of an HTTP error reply with this status and body. SGLang's error bodies: `{"error":
    "text"}` (schema errors; a missing or wrong key: 401 "Unauthorized"), `{"error": {"message", ...}}`
    (a refused request), `{"object": "error", "message", "code"}` (FastAPI validation), `{"detail": "Not
    Found"}` (an unknown path or method), `{"success": false, "message"}` (control calls), or plain text.
    Retryable: the body's `retryable`, else 5xx and 409."""
    default_retry = status >= 500 or status == 409
    try:
        obj = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return EngineError(status, body.decode(errors="replace"), default_retry)
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    if isinstance(err, dict):
        message = err.get("message", err.get("detail", err))
        kind = err.get("type")
        retry = bool(err.get("retryable", default_retry))
        return EngineError(status, str(message), retry, kind if isinstance(kind, str) else "")
    return EngineError(status, str(err), default_retry)


def stream_error(data: bytes) -> EngineError | None:
    """The error of an SSE `data:` event that carries one (SGLang: `{"error": {"message", "type", "code",
    "retryable"}}` once the stream has begun), with the status in its `code` (500 if none); else None."""
    if not data.lstrip().startswith(b'{"error"'):
        return None
    try:
        err = msgspec.json.decode(data).get("error")
    except (msgspec.DecodeError, AttributeError):
        return EngineError(502, data.decode(errors="replace"), True)
    code = err.get("code") if isinstance(err, dict) else None
    return error_from(code if isinstance(code, int) and code >= 400 else 500, data)


def encode_safetensors_payload(tensors: Mapping[str, Any]) -> str:
    """base64 of a safetensors file holding `tensors` (numpy arrays), for /update_weights_from_tensor with
    load_format='safetensors' (gyre-engine). Torch tensors: use safetensors.torch.save and b64-encode."""
    from safetensors.numpy import save

    return base64.b64encode(save(dict(tensors))).decode()


PROBE_CONNECTIONS = 2
"""Connections of the health-probe pool (`health`, `ready`, `health_generate`): nothing else uses it."""
ABORT_CONNECTIONS = 16
"""Connections of the abort pool (`abort`, `abort_all`): aborts wait here for a free one, never behind
generation or weight updates."""
ABORT_TIMEOUT_S = 10.0
"""Longest an abort takes, its wait for a connection included (an engine that does not answer by then
is not running the request for anybody)."""


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The TLS settings every pool of every `EngineClient` in the process shares: httpx's default context
    (certificates verified against certifi's bundle, or `SSL_CERT_FILE` / `SSL_CERT_DIR` when set), built
    once. Left to httpx, each pool builds its own and loads the bundle again, about 20 ms each here: with
    three pools a client took 60 ms to make, paid by every short-lived client (a cell makes one per engine
    call, a weight push among them)."""
    return httpx.create_ssl_context()


class EngineClient:
    """One server's native API. Use as `async with EngineClient(url) as c: await c.generate(...)`.

    `api_key` is the token the server checks (gyre-engine's run token, SGLang's `--api-key`); "" reads
    `$GYRE_TOKEN`, and with neither the requests carry no `Authorization` header. Three connection pools:
    health probes and aborts have their own small ones (module docstring), the rest share the third."""

    def __init__(
        self, base_url: str, timeout_s: float = 600.0, connect_timeout_s: float = 5.0, *, api_key: str = ""
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers: dict[str, str] = {"content-type": "application/json", **bearer(resolve_token(api_key))}
        """What every request of this client carries (JSON content type, the token); for callers that
        send their own requests to the same server (gyre-proxy's streaming /generate)."""
        self._http = self._pool(httpx.Timeout(timeout_s, connect=connect_timeout_s), httpx.Limits())
        self._probe = self._pool(
            httpx.Timeout(30.0, connect=connect_timeout_s),
            httpx.Limits(max_connections=PROBE_CONNECTIONS, max_keepalive_connections=PROBE_CONNECTIONS),
        )
        self._abort = self._pool(
            httpx.Timeout(ABORT_TIMEOUT_S, connect=min(connect_timeout_s, ABORT_TIMEOUT_S)),
            httpx.Limits(max_connections=ABORT_CONNECTIONS, max_keepalive_connections=ABORT_CONNECTIONS),
        )
        self._sglang: bool | None = None  # SGLang or gyre-engine, once `load` has asked

    def _pool(self, timeout: httpx.Timeout, limits: httpx.Limits) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.base_url, timeout=timeout, limits=limits, headers=self.headers, verify=tls_context()
        )

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for pool in (self._http, self._probe, self._abort):
            await pool.aclose()

    # ----------------------------------------------------------------- plumbing
    async def _post(
        self, path: str, body: msgspec.Struct | None = None, timeout: float | None = None
    ) -> httpx.Response:
        """POST `body` (its struct as JSON; `{}` for none) and return the reply, or raise EngineError."""
        kw: dict[str, Any] = {"content": _enc.encode(body) if body is not None else b"{}"}
        if timeout is not None:
            kw["timeout"] = timeout
        r = await self._http.post(path, **kw)
        if r.status_code >= 400:
            raise error_from(r.status_code, r.content)
        return r

    async def _get(self, path: str, timeout: float | None = None) -> httpx.Response:
        r = await self._http.get(path, timeout=timeout) if timeout is not None else await self._http.get(path)
        if r.status_code >= 400:
            raise error_from(r.status_code, r.content)
        return r

    @staticmethod
    def generate_request(
        input_ids: list[int] | list[list[int]],
        sampling: SamplingParams | None = None,
        *,
        rid: str | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        stream: bool = False,
    ) -> GenerateRequest:
        """The /generate body for one input (or a batch of them): top logprobs only with logprobs."""
        return GenerateRequest(
            input_ids=cast("list[int | list[int]]", input_ids),
            sampling_params=msgspec.to_builtins(sampling or SamplingParams()),
            rid=rid,
            return_logprob=return_logprob,
            top_logprobs_num=top_logprobs_num if return_logprob else 0,
            stream=stream,
        )

    # ----------------------------------------------------------------- generation
    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams | None = None,
        *,
        rid: str | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        timeout: float | None = None,
    ) -> GenerateResponse:
        body = self.generate_request(
            input_ids, sampling, rid=rid, return_logprob=return_logprob, top_logprobs_num=top_logprobs_num
        )
        return _gen_dec.decode((await self._post("/generate", body, timeout)).content)

    async def generate_batch(
        self, batch: list[list[int]], sampling: SamplingParams | None = None, *, return_logprob: bool = False
    ) -> list[GenerateResponse]:
        body = self.generate_request(batch, sampling, return_logprob=return_logprob)
        return _gen_list_dec.decode((await self._post("/generate", body)).content)

    async def stream(
        self,
        input_ids: list[int],
        sampling: SamplingParams | None = None,
        *,
        rid: str | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
    ) -> AsyncIterator[GenerateResponse]:
        """Cumulative chunks as the server sends them; ends at `[DONE]`."""
        body = self.generate_request(
            input_ids,
            sampling,
            rid=rid,
            return_logprob=return_logprob,
            top_logprobs_num=top_logprobs_num,
            stream=True,
        )
        async with self._http.stream("POST", "/generate", content=_enc.encode(body)) as r:
            if r.status_code >= 400:
                raise error_from(r.status_code, await r.aread())
            async for data in data_fields(r.aiter_bytes()):  # not aiter_lines: see sse.py
                if data == b"[DONE]":
                    return
                err = stream_error(data)
                if err is not None:
                    raise err
                yield _gen_dec.decode(data)

    # ----------------------------------------------------------------- control
    async def abort(self, rid: str, timeout: float = ABORT_TIMEOUT_S) -> None:
        """Stop request `rid` (its own pool; `timeout` bounds the wait for a connection too). Cancelling
        the caller while this waits for a connection may leak it in httpx 0.28 / httpcore 1.0.9
        (encode/httpcore#1093): bound it with `timeout`, not with a cancellation."""
        await self._abort_post(AbortRequest(rid=rid), timeout)

    async def abort_all(self, timeout: float = ABORT_TIMEOUT_S) -> None:
        await self._abort_post(AbortRequest(abort_all=True), timeout)

    async def _abort_post(self, body: AbortRequest, timeout: float) -> None:
        r = await self._abort.post("/abort_request", content=_enc.encode(body), timeout=timeout)
        if r.status_code >= 400:
            raise error_from(r.status_code, r.content)

    async def pause(self, mode: PauseMode = "abort") -> StatusReply:
        r = await self._post("/pause_generation", PauseRequest(mode))
        return msgspec.json.decode(r.content, type=StatusReply)

    async def continue_generation(self, torch_empty_cache: bool = False) -> StatusReply:
        r = await self._post("/continue_generation", ContinueRequest(torch_empty_cache))
        return msgspec.json.decode(r.content, type=StatusReply)

    async def begin_weight_update(self) -> SuccessReply:
        return msgspec.json.decode((await self._post("/begin_weight_update")).content, type=SuccessReply)

    async def end_weight_update(self) -> SuccessReply:
        return msgspec.json.decode((await self._post("/end_weight_update")).content, type=SuccessReply)

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        *,
        load_format: str | None = None,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> SuccessReply:
        """SGLang wants its own (pickled) serialization, made by SGLang's helpers on the trainer side;
        gyre-engine wants load_format='safetensors' and `encode_safetensors_payload` entries."""
        body = UpdateFromTensorRequest(
            serialized_named_tensors,
            load_format=load_format,
            flush_cache=flush_cache,
            abort_all_requests=abort_all_requests,
            weight_version=weight_version,
        )
        return msgspec.json.decode(
            (await self._post("/update_weights_from_tensor", body)).content, type=SuccessReply
        )

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> SuccessReply:
        body = UpdateFromDiskRequest(
            model_path,
            abort_all_requests=abort_all_requests,
            weight_version=weight_version,
            flush_cache=flush_cache,
        )
        return msgspec.json.decode(
            (await self._post("/update_weights_from_disk", body)).content, type=SuccessReply
        )

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
        *,
        timeout_s: float | None = None,
    ) -> SuccessReply:
        """Join the trainer's weight-update group (rank 0 is the trainer; this engine's ranks start at
        `rank_offset`). Returns once the whole group has formed, so the trainer must form its rank 0 at
        the same time. `timeout_s` (gyre-engine; SGLang ignores it) bounds the forming and each
        broadcast; the HTTP wait is that plus 30 s."""
        body = InitWeightsUpdateGroupRequest(
            master_address, master_port, rank_offset, world_size, group_name, backend
        )
        if timeout_s is not None:  # else the server's default (`WEIGHT_GROUP_TIMEOUT_S`), and SGLang's wait
            body = msgspec.structs.replace(body, timeout_s=timeout_s)
        wait = None if timeout_s is None else timeout_s + 30.0
        return msgspec.json.decode(
            (await self._post("/init_weights_update_group", body, timeout=wait)).content, type=SuccessReply
        )

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        *,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        http_timeout_s: float | None = None,
    ) -> SuccessReply:
        """The trainer's rank 0 then broadcasts each tensor over the group, in the order of `names`;
        the reply comes once they are all received and loaded. `dtypes` are torch dtype names
        ("bfloat16", "float32", ...)."""
        body = UpdateFromDistributedRequest(
            names,
            dtypes,
            shapes,
            group_name,
            flush_cache=flush_cache,
            abort_all_requests=abort_all_requests,
            weight_version=weight_version,
        )
        return msgspec.json.decode(
            (await self._post("/update_weights_from_distributed", body, timeout=http_timeout_s)).content,
            type=SuccessReply,
        )

    async def destroy_weights_update_group(self, group_name: str) -> SuccessReply:
        """Leave the weight-update group `group_name`."""
        r = await self._post("/destroy_weights_update_group", DestroyWeightsUpdateGroupRequest(group_name))
        return msgspec.json.decode(r.content, type=SuccessReply)

    async def release_memory(self, tags: list[str] | None = None) -> None:
        await self._post("/release_memory_occupation", MemoryRequest(tags))

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        await self._post("/resume_memory_occupation", MemoryRequest(tags))

    async def flush_cache(self) -> None:
        await self._post("/flush_cache")

    async def model_info(self) -> ModelInfo:
        return msgspec.json.decode((await self._get("/model_info")).content, type=ModelInfo)

    async def server_info(self) -> ServerInfo:
        """gyre-engine only (its counters); SGLang's /server_info is its configuration (see `load`)."""
        return msgspec.json.decode((await self._get("/server_info")).content, type=ServerInfo)

    async def loads(self) -> Loads:
        """SGLang only: GET /v1/loads, the load of each data-parallel rank."""
        return msgspec.json.decode((await self._get("/v1/loads")).content, type=Loads)

    async def load(self) -> EngineLoad:
        """Running and waiting requests, a work counter and the weight version, from either server:
        gyre-engine's counters in its /server_info, or SGLang's /v1/loads (summed over its ranks) and
        /model_info. Which one this server is, is found on the first call (a /server_info that is not
        gyre's, or none at all, is SGLang's way)."""
        if self._sglang is None:
            try:
                r = await self._get("/server_info")
                info = msgspec.json.decode(r.content, type=ServerInfo)
            except msgspec.ValidationError:  # SGLang's configuration
                self._sglang = True
            except EngineError as exc:
                if exc.status != 404:  # not served: SGLang's, or gyre-engine standing in for it
                    raise
                self._sglang = True
            else:
                self._sglang = False
                return _gyre_load(info)
        if not self._sglang:
            return _gyre_load(await self.server_info())
        loads, model = await self.loads(), await self.model_info()
        moments = [x.decode_moments for x in loads.loads if x.decode_moments and len(x.decode_moments) >= 3]
        return EngineLoad(
            running=sum(x.num_running_reqs for x in loads.loads),
            waiting=sum(x.num_waiting_reqs for x in loads.loads),
            work=sum(
                x.total_prefill_uncached_tokens + int(x.decode_moments[0] if x.decode_moments else 0)
                for x in loads.loads
            ),
            weight_version=model.weight_version,
            source="sglang",
            counters=EngineCounters(
                decode_steps=sum(int(m[0]) for m in moments),
                decode_tokens=sum(int(m[1]) for m in moments),
                decode_s=sum(m[2] for m in moments) / 1e6,
                prefill_tokens=sum(x.total_prefill_uncached_tokens for x in loads.loads),
                prefill_s=(sum(x.total_prefill_busy_us for x in loads.loads) / 1e6) or None,  # 0: not counted
            ),
        )

    async def health(self, timeout: float = 30.0) -> bool:
        return await self._ok("/health", timeout)

    async def health_generate(self, timeout: float = 30.0) -> bool:
        return await self._ok("/health_generate", timeout)

    async def ready(self, timeout: float = 10.0) -> bool:
        return await self._ok("/ready", timeout)

    async def _ok(self, path: str, timeout: float) -> bool:
        """Whether `path` answers 200 within `timeout` (the probe pool: load cannot fill it)."""
        try:
            r = await self._probe.get(path, timeout=timeout)
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    # ----------------------------------------------------------------- gyre-engine's KV prefix hand-off
    async def export_prefix(self, input_ids: list[int], timeout: float | None = None) -> KvPrefix | None:
        """gyre-engine only: the KV of the longest cached prefix of `input_ids` (None if none)."""
        kw: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        body = _enc.encode(ExportPrefixRequest(input_ids))
        r = await self._http.post("/export_prefix", content=body, **kw)
        if r.status_code == 404:
            return None
        if r.status_code >= 400:
            raise error_from(r.status_code, r.content)
        return KV_PREFIX_DECODER.decode(r.content)

    async def import_prefix(self, rec: KvPrefix, timeout: float | None = None) -> SuccessReply:
        """gyre-engine only: put an exported prefix into this server's prefix cache."""
        kw: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        r = await self._http.post(
            "/import_prefix",
            content=KV_PREFIX_ENCODER.encode(rec),
            headers={"content-type": "application/msgpack"},
            **kw,
        )
        if r.status_code >= 400:
            raise error_from(r.status_code, r.content)
        return msgspec.json.decode(r.content, type=SuccessReply)

    # ----------------------------------------------------------------- gyre-engine over gyre-xfer
    async def update_weights_from_xfer(
        self,
        publisher: str,
        *,
        min_version: int = 0,
        transport: Transport = "shm",
        timeout_s: float = 120.0,
        control_timeout_s: float = 10.0,
        weight_version: str | None = None,
        layout: WeightLayout = "transformers",
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> XferWeightsReply:
        """gyre-engine only: pull the newest gyre-xfer snapshot >= `min_version` from `publisher` (its
        control address) and load it between two decode steps; any failure changes nothing."""
        body = UpdateFromXferRequest(
            publisher,
            min_version=min_version,
            transport=transport,
            timeout_s=timeout_s,
            control_timeout_s=control_timeout_s,
            weight_version=weight_version,
            layout=layout,
            flush_cache=flush_cache,
            abort_all_requests=abort_all_requests,
        )
        r = await self._post("/update_weights_from_xfer", body, timeout_s + 2 * control_timeout_s + 30)
        return msgspec.json.decode(r.content, type=XferWeightsReply)

    async def offer_prefix(
        self,
        input_ids: list[int],
        *,
        transport: PrefixTransport = "shm",
        block_tokens: int = 16,
        lease_s: float = 120.0,
        timeout: float | None = None,
    ) -> PrefixOffer | None:
        """gyre-engine only: expose the cached prefix of `input_ids` in a registered KV pool, or with
        "cuda_ipc" in a device buffer another engine on the same GPU can map (None if nothing is cached).
        Release it with `release_prefix_offer` (else it expires after `lease_s`)."""
        body = OfferPrefixRequest(input_ids, transport=transport, block_tokens=block_tokens, lease_s=lease_s)
        kw: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        r = await self._http.post("/offer_prefix", content=_enc.encode(body), **kw)
        if r.status_code == 404:
            return None
        if r.status_code >= 400:
            raise error_from(r.status_code, r.content)
        return msgspec.json.decode(r.content, type=PrefixOffer)

    async def import_prefix_xfer(self, offer: PrefixOffer, *, timeout_s: float = 30.0) -> PrefixImportReply:
        """gyre-engine only: pull an offer's KV blocks from the source engine and install them in this
        engine's prefix cache; all or nothing (EngineError 502/504 naming the blocks that failed)."""
        body = ImportPrefixXferRequest(offer, timeout_s=timeout_s)
        r = await self._post("/import_prefix_xfer", body, timeout_s + 30)
        return msgspec.json.decode(r.content, type=PrefixImportReply)

    async def release_prefix_offer(
        self, offer_id: str, arrived: list[int] | None = None, failed: list[int] | None = None
    ) -> SuccessReply:
        """gyre-engine only: the receipt; the source frees the offer's pool."""
        body = ReleaseOfferRequest(offer_id, arrived=arrived or [], failed=failed or [])
        return msgspec.json.decode(
            (await self._post("/release_prefix_offer", body)).content, type=SuccessReply
        )


def _gyre_load(info: ServerInfo) -> EngineLoad:
    return EngineLoad(
        running=info.running_requests,
        waiting=info.waiting_requests,
        work=info.decode_steps + info.prefill_tokens_computed,
        weight_version=info.weight_version,
        source="gyre-engine",
        counters=EngineCounters(
            decode_steps=info.decode_steps,
            decode_tokens=info.decode_tokens,
            decode_s=info.decode_time_s,
            prefill_tokens=info.prefill_tokens_computed,
            prefill_s=info.prefill_time_s,
            evicted_tokens=info.memory_evicted_tokens,
            host_spilled_tokens=info.host_spilled_tokens,
            host_hit_tokens=info.host_hit_tokens,
            step_s=info.step_time_s,
            command_s=info.command_time_s,
            waiting_s=info.waiting_s or None,
            graph_captures=info.graph_captures,
            graph_capture_s=info.graph_capture_s,
            prefill_passes=info.prefill_passes,
            prefill_graph_passes=info.prefill_graph_passes,
        ),
    )


async def handoff_prefix(
    source: EngineClient,
    target: EngineClient,
    input_ids: list[int],
    *,
    transport: PrefixTransport = "shm",
    timeout_s: float = 30.0,
    block_tokens: int = 16,
) -> PrefixImportReply | None:
    """Move the cached prefix of `input_ids` from `source` to `target` through gyre-xfer: offer, pull,
    receipt. None if the source caches nothing of it; the offer is released whatever happens.

    "cuda_ipc": device to device when both engines are on one GPU; when the target is on another GPU or
    off CUDA it refuses the offer before reading anything (CUDA_IPC_UNREACHABLE), which is released and
    made again over shared memory. The reply's `transport` says which way the KV went."""
    try:
        return await _handoff(source, target, input_ids, transport, timeout_s, block_tokens)
    except EngineError as exc:
        if transport != "cuda_ipc" or exc.err_type != CUDA_IPC_UNREACHABLE:
            raise
    return await _handoff(source, target, input_ids, "shm", timeout_s, block_tokens)


async def _handoff(
    source: EngineClient,
    target: EngineClient,
    input_ids: list[int],
    transport: PrefixTransport,
    timeout_s: float,
    block_tokens: int,
) -> PrefixImportReply | None:
    offer = await source.offer_prefix(input_ids, transport=transport, block_tokens=block_tokens)
    if offer is None:
        return None
    arrived: list[int] = []
    try:
        reply = await target.import_prefix_xfer(offer, timeout_s=timeout_s)
        arrived = [b.src_block for b in reply.blocks if b.status == "OK"]
        return reply
    finally:
        # a dead source frees nothing anyway; the offer also expires after its lease
        with contextlib.suppress(EngineError, httpx.HTTPError):
            await source.release_prefix_offer(offer.offer_id, arrived=arrived)
