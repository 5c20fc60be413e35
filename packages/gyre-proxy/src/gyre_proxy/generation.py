"""One model call over the engine pool, continued across engines so the harness sees one response.

A `Generation` streams SGLang's native `/generate` (input ids, logprobs, cumulative chunks) from the
engine the pool picks. When the engine is drained (the call is told to move), removed, dies or aborts the
request, the tokens generated so far are kept and the call continues on another engine with input =
original input + partial output and the remaining token budget; both parts' logprobs are kept. Where
both engines are gyre-engines the cached prefix goes along (`kvmove.py`), otherwise it is re-prefilled;
both are counted. Before its first attempt a call may move its execution to a less loaded engine
(`EnginePool.rebalance`); its cached prefix then goes along the same way. The request body is assembled from cached JSON fragments, never re-encoded from ints.

A call cancelled mid-attempt (its client left) aborts its engine request (`/abort_request` with the
attempt's rid, sent from a task of its own so the cancellation cannot stop it) and is never resubmitted:
only a call whose caller is still waiting continues after an engine-side abort. Its reader of the engine
stream is cancelled once the response has started (or a bounded wait for that has passed), so the request
is out before its connection closes. The stream goes through `upstream.UpstreamClient` (kept-alive
HTTP/1.1, httptools' parser), whose failures are httpx's transport errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
import numpy as np
from gyre_engine.client import EngineError, error_from, stream_error
from gyre_engine.protocol import GenerateResponse
from gyre_engine.sse import data_fields

from gyre_proxy import kvmove
from gyre_proxy.chat import Sampling
from gyre_proxy.engines import Engine, EnginePool, EngineState, InFlight
from gyre_proxy.upstream import UpstreamClient

log = logging.getLogger("gyre_proxy.generation")
_enc = msgspec.json.Encoder()
_chunk_dec = msgspec.json.Decoder(GenerateResponse)
_stopping: set[asyncio.Task[None]] = set()  # readers being stopped in the background (kept referenced)
CONNECT_WAIT_S = 10.0
"""How long a reader whose call ended gets to receive its response's start before it is cancelled anyway."""


async def _stop_reader(reader: asyncio.Task[None], connected: asyncio.Event, wait_s: float) -> None:
    """Cancel `reader` once its response has started (or after `wait_s`), then wait for it to end."""
    if not connected.is_set():
        started = asyncio.ensure_future(connected.wait())
        await asyncio.wait({reader, started}, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
        started.cancel()
    reader.cancel()
    with contextlib.suppress(BaseException):
        await reader


def _stop_reader_soon(reader: asyncio.Task[None], connected: asyncio.Event, wait_s: float) -> None:
    task = asyncio.get_running_loop().create_task(_stop_reader(reader, connected, wait_s))
    _stopping.add(task)
    task.add_done_callback(_stopping.discard)


@dataclass
class Counters:
    """Proxy-wide counts of continuation work (exposed on /gyre/stats)."""

    moved_calls: int = 0
    prefix_moved_calls: int = 0
    """Moved calls whose cached prefix (KV) went along to the next engine instead of being re-prefilled."""
    prefix_moved_tokens: int = 0
    reprefilled_tokens: int = 0
    engine_errors: int = 0
    rebalanced_calls: int = 0
    """Calls whose execution moved to a less loaded engine before the call began."""
    prefix_move_s: float = 0.0
    """Seconds spent taking prefixes out of engines and putting them into others."""


@dataclass
class GenResult:
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)  # when asked: per token
    finish: str = "stop"  # "stop" | "length"
    weight_version: int = 0
    engines: list[int] = field(default_factory=list)
    moves: int = 0
    engine_s: float = 0.0
    cached_tokens: int = 0
    matched: str = ""  # the stop string that ended the call, if one did


class GenerationFailed(RuntimeError):
    """The call could not be completed on any engine within its attempts (the harness gets a 5xx)."""


def _version(v: str) -> int:
    try:
        return max(0, int(v))
    except ValueError:
        return 0


def sampling_params(s: Sampling, max_new: int) -> dict[str, Any]:
    sp: dict[str, Any] = {"max_new_tokens": max_new, "temperature": s.temperature, "top_p": s.top_p}
    if s.top_k > 0:
        sp["top_k"] = s.top_k
    if s.stop:
        sp["stop"] = list(s.stop)
    if s.seed is not None:
        sp["sampling_seed"] = s.seed
    if s.presence_penalty:
        sp["presence_penalty"] = s.presence_penalty
    if s.frequency_penalty:
        sp["frequency_penalty"] = s.frequency_penalty
    if s.logit_bias:
        sp["logit_bias"] = {str(t): b for t, b in s.logit_bias}
    if s.min_new_tokens:
        sp["min_new_tokens"] = s.min_new_tokens
    if s.ignore_eos:
        sp["ignore_eos"] = True
    sp["skip_special_tokens"] = False
    sp["no_stop_trim"] = True
    return sp


class EngineRejected(ValueError):
    """The engine refused the request itself (HTTP 4xx, not retryable): retrying elsewhere cannot help."""


class _Moved(Exception):
    pass


class _NoAnswer(httpx.TransportError):
    """The connection failed before the engine's response began: most often a kept-alive connection the
    engine closed as this request went out (an idle timeout); the pool drops it, and the call goes once
    more to the same engine on another connection."""


REFUSED_WAIT_S = 0.1
REFUSED_WAIT_MAX_S = 2.0
"""After an engine failed a call or refused it as unavailable (a 409 while its memory is released), the
next attempt goes at once to another engine taking requests; where there is none but engines already
tried, it waits first: 0.1 s, doubling to at most 2 s, or until the pool changes (an engine added,
revived or drained). So a lone engine caught between its release and its drain is not spent through
every attempt in milliseconds: its drain comes, and the call waits for an engine as any other would."""


_MOVE = object()
"""Put in an attempt's queue when its call is told to move (a drain, a removal)."""


class Generation:
    """Run with `async for new_ids in gen.stream(): ...`; then read `gen.result`."""

    def __init__(
        self,
        pool: EnginePool,
        http: UpstreamClient,
        counters: Counters,
        rid: str,
        execution: str,
        input_ids: np.ndarray,
        input_json: bytes,
        sampling: Sampling,
        *,
        pick_wait_s: float = 5.0,
        max_attempts: int = 8,
        stream_interval: int = 4,
        abort_grace_s: float = 5.0,
        kv_transport: str = "shm",
    ) -> None:
        self.pool = pool
        self.http = http
        self.counters = counters
        self.rid = rid
        self.execution = execution
        self.input_ids = input_ids
        self.input_json = input_json
        self.sampling = sampling
        self.pick_wait_s = pick_wait_s
        self.max_attempts = max_attempts
        self.stream_interval = stream_interval
        self.abort_grace_s = abort_grace_s
        self.kv_transport = kv_transport
        self.result = GenResult()
        self._versions: list[int] = []

    def _body(self, attempt_rid: str) -> bytes:
        out = self.result.output_ids
        ids = self.input_json
        if out:
            tail = ",".join(map(str, out)).encode()
            ids = ids + b"," + tail if ids else tail
        left = self.sampling.max_new_tokens - len(out)
        sp = sampling_params(self.sampling, left)
        sp["stream_interval"] = self.stream_interval
        return (
            b'{"rid":'
            + _enc.encode(attempt_rid)
            + b',"input_ids":['
            + ids
            + b'],"sampling_params":'
            + _enc.encode(sp)
            + b',"return_logprob":true'
            + (b',"top_logprobs_num":%d' % self.sampling.top_logprobs if self.sampling.top_logprobs else b"")
            + b',"stream":true}'
        )

    async def stream(self) -> AsyncIterator[list[int]]:
        exclude: frozenset[int] = frozenset()
        fresh: set[int] = set()  # engines this call already tried again on a new connection
        prev: Engine | None = None
        carried: kvmove.Carried | None = None
        refused = 0  # attempts that an engine failed or refused as unavailable
        moving = self.pool.rebalance(self.execution)
        if moving is not None:
            self.counters.rebalanced_calls += 1
            carried = await self._take_out(moving[0], self.input_ids.tolist())
        for attempt in range(self.max_attempts):
            eng = await self.pool.wait_pick(self.execution, self.pick_wait_s, exclude)
            wait_s = 0.0
            work = int(self.input_ids.size) + self.sampling.max_new_tokens
            attempt_rid = self.rid if attempt == 0 else f"{self.rid}.{attempt}"
            # in flight from here: a drain of `eng` waits for the prefix being put in, not only the stream
            f = self.pool.begin(eng, attempt_rid, self.execution, work)
            self.result.engines.append(eng.engine_id)
            t0 = time.perf_counter()
            try:
                if prev is not None:
                    await self._put_in(carried, eng)
                elif carried is not None:  # rebalanced: only the taken-out prefix would be prefilled again
                    await self._put_in(carried, eng, of=carried.tokens)
                carried = None
                async for new in self._attempt(eng, f, attempt_rid):
                    yield new
                return
            except _Moved:
                self.result.moves += 1
                self.counters.moved_calls += 1
                log.info(
                    "call %s moves off engine %d after %d tokens",
                    self.rid,
                    eng.engine_id,
                    len(self.result.output_ids),
                )
                # Still in flight on the old engine: a drain waits for this, so the engine's memory is
                # not released (its prefix cache cleared) before the KV is out.
                carried = await self._take_out(eng, self._ids())
            except (httpx.TransportError, EngineError) as exc:
                self.counters.engine_errors += 1
                if isinstance(exc, _NoAnswer) and eng.engine_id not in fresh:
                    fresh.add(eng.engine_id)  # once per engine: a dead one fails again, and is set aside
                    log.info(
                        "call %s: engine %d: %s; once more on another connection",
                        self.rid,
                        eng.engine_id,
                        exc,
                    )
                    continue
                if isinstance(exc, EngineError) and 400 <= exc.status < 500 and not exc.retryable:
                    raise EngineRejected(exc.message) from None
                self.result.moves += 1
                if isinstance(exc, httpx.TransportError):
                    self.pool.mark_dead(eng)
                log.warning(
                    "call %s: engine %d failed (%s); continuing elsewhere", self.rid, eng.engine_id, exc
                )
                exclude = exclude | {eng.engine_id}
                refused += 1
                wait_s = min(REFUSED_WAIT_MAX_S, REFUSED_WAIT_S * 2 ** (refused - 1))
            finally:
                self.result.engine_s += time.perf_counter() - t0
                self.pool.end(eng, f)
            prev = eng
            if len(self.result.output_ids) >= self.sampling.max_new_tokens:
                self.result.finish = "length"
                return
            if wait_s:  # before the same engines again where no other takes requests (a drain may be on)
                await self.pool.wait_for_another(exclude, wait_s)
        raise GenerationFailed(f"call {self.rid} did not complete after {self.max_attempts} engine attempts")

    async def _attempt(self, eng: Engine, f: InFlight, attempt_rid: str) -> AsyncIterator[list[int]]:
        """One engine's stream. Its reader task fills one queue; being told to move (`f.wake`) puts a
        marker in the same queue, so each chunk costs one wait, with no task of its own."""
        queue: asyncio.Queue[GenerateResponse | BaseException | object | None] = asyncio.Queue()
        f.wake = lambda: queue.put_nowait(_MOVE)
        if f.move.is_set():  # told to move before this attempt began
            queue.put_nowait(_MOVE)
        connected = asyncio.Event()  # the engine's response has started: the reader holds its connection
        reader = asyncio.create_task(self._read(eng, attempt_rid, queue, connected))
        base = len(self.result.output_ids)
        seen = 0
        abort_deadline = 0.0  # set once the call was told to move: how long the engine gets to stop
        finished = False  # the engine reported a finish reason (its row is free)
        loop = asyncio.get_running_loop()
        try:
            while True:
                if abort_deadline:
                    try:
                        async with asyncio.timeout(max(0.0, abort_deadline - loop.time())):
                            item = await queue.get()
                    except TimeoutError:
                        raise _Moved() from None  # the engine did not end the aborted stream in time
                else:
                    item = await queue.get()
                if item is _MOVE:
                    if abort_deadline:
                        continue
                    abort_deadline = loop.time() + self.abort_grace_s
                    if eng.state is EngineState.REMOVED:
                        raise _Moved()
                    # shielded: if this call is cancelled meanwhile, the abort still goes out whole
                    await asyncio.shield(self.pool.abort_soon(eng, attempt_rid, self.abort_grace_s))
                    continue
                if item is None:
                    raise _Moved()  # the stream ended without a finish reason
                if isinstance(item, BaseException):
                    raise item
                assert isinstance(item, GenerateResponse)
                new = item.output_ids[seen:]
                lps = item.meta_info.output_token_logprobs or []
                if new:
                    self.result.output_ids.extend(new)
                    got = lps[seen : seen + len(new)]
                    if len(got) != len(new):  # a record without the sampled logprobs is no use to train on
                        raise EngineError(
                            502,
                            f"engine {eng.engine_id} sent {len(got)} logprobs for {len(new)} tokens",
                            True,
                        )
                    self.result.logprobs.extend(float(e[0]) for e in got)
                    if self.sampling.top_logprobs:
                        self._take_top(eng, item, seen, len(new))
                    seen += len(new)
                    yield list(new)
                fin = item.meta_info.finish_reason
                if fin is not None:
                    finished = True
                    self._versions.append(_version(item.meta_info.weight_version))
                    self.result.weight_version = min(self._versions)
                    if base == 0:
                        self.result.cached_tokens = item.meta_info.cached_tokens
                    if fin.type == "abort":
                        refused = fin.status_code is not None and 400 <= fin.status_code < 500
                        if refused and not abort_deadline:  # not our abort: the engine refused the request
                            raise EngineRejected(fin.message or "aborted by the engine")
                        raise _Moved()  # drained, paused for a weight update, ...: continue elsewhere
                    self.result.finish = "length" if fin.type == "length" else "stop"
                    if isinstance(fin.matched, str):
                        self.result.matched = fin.matched
                    return
        finally:
            f.wake = None
            if not reader.done():
                # in the background: this task may itself be cancelled again while it waits
                _stop_reader_soon(reader, connected, CONNECT_WAIT_S)
            if not finished and not abort_deadline:
                # left before the engine finished, and not aborted above: the client went away (this
                # task was cancelled) or the stream broke; the engine must not go on generating for it
                self.pool.abort_soon(eng, attempt_rid, self.abort_grace_s)

    def _take_top(self, eng: Engine, item: GenerateResponse, seen: int, n: int) -> None:
        tops = (item.meta_info.output_top_logprobs or [])[seen : seen + n]
        if len(tops) != n:
            raise EngineError(
                502, f"engine {eng.engine_id} sent {len(tops)} top-logprob lists for {n} tokens", True
            )
        self.result.top_logprobs.extend(
            [(float("-inf") if e[0] is None else float(e[0]), int(e[1])) for e in t or []] for t in tops
        )

    async def _read(
        self,
        eng: Engine,
        attempt_rid: str,
        q: asyncio.Queue[GenerateResponse | BaseException | object | None],
        connected: asyncio.Event,
    ) -> None:
        body = self._body(attempt_rid)
        headers = eng.client.headers  # JSON, and the run token the engine checks (`$GYRE_TOKEN`)
        try:
            async with self.http.stream(f"{eng.url}/generate", body, headers) as r:
                connected.set()
                if r.status_code >= 400:  # retryable as the body says (a released engine's 409 is)
                    await q.put(error_from(r.status_code, await r.aread()))
                    return
                async for data in data_fields(r.aiter_bytes()):  # not aiter_lines: see gyre_engine.sse
                    if data == b"[DONE]":
                        continue  # read to the end so the connection goes back to the pool
                    if (err := stream_error(data)) is not None:
                        await q.put(err)
                        return
                    await q.put(_chunk_dec.decode(data))
            await q.put(None)
        except (httpx.HTTPError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            if isinstance(exc, msgspec.MsgspecError):
                await q.put(EngineError(502, f"bad chunk from engine {eng.engine_id}: {exc}", True))
            elif isinstance(exc, httpx.TransportError) and not connected.is_set():
                await q.put(_NoAnswer(f"no answer ({type(exc).__name__}: {exc})"))
            else:
                await q.put(exc)
        except Exception as exc:  # anything else still ends the call (its reader waits on this queue)
            log.exception("call %s: reading engine %d's stream failed", attempt_rid, eng.engine_id)
            await q.put(EngineError(502, f"reading engine {eng.engine_id}'s stream failed: {exc!r}", True))

    def _ids(self) -> list[int]:
        return [*self.input_ids.tolist(), *self.result.output_ids]

    async def _take_out(self, old: Engine, ids: list[int]) -> kvmove.Carried | None:
        got = await kvmove.take_out(old, ids, self.kv_transport)
        if got is not None:
            self.counters.prefix_move_s += got.out_s
        return got

    async def _put_in(self, carried: kvmove.Carried | None, new: Engine, of: int | None = None) -> None:
        """Install a taken-out prefix in `new`; count the tokens moved and those to prefill again (of
        `of` tokens the old engine held; default: the call's whole input so far)."""
        t0 = time.perf_counter()
        moved = await kvmove.put_in(carried, new)
        if carried is not None and carried.source is new:
            return  # back on its engine, whose cache still holds the prefix: nothing moved or lost
        if carried is not None:
            self.counters.prefix_move_s += time.perf_counter() - t0
        self.counters.prefix_moved_calls += moved > 0
        self.counters.prefix_moved_tokens += moved
        self.counters.reprefilled_tokens += (len(self._ids()) if of is None else of) - moved
