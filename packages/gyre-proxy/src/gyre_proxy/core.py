"""The API-neutral heart of the proxy: render a conversation exactly, run it on an engine, record it.

`Proxy.start_call` classifies the call (role, agent id), renders it (incrementally, reusing recorded
output ids, the agent's own first) and checks the context size; `CallRun.blocks` streams the parsed output
(thinking, text, tool calls) as tokens arrive; `CallRun.finish` remembers the output for later renders and
writes the call's TITO record (delta-encoded against the same agent's previous call, else the last call
with the same system and tools; metadata: the call it `extends` when the harness only appended, and the
harness metadata stripped from the prompt) to the fsynced log before the API layer completes its response.
A call whose record could not be written fails with `RecordWriteFailed` (and is not in the log). The
proxy's state (render caches, recorded outputs, counters) is touched only through `Proxy.owned`, which
runs a request's work on the worker thread when the request is large and on the event loop only when it
is small (bounded work) and nothing waits for the worker.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import secrets
import ssl
import threading
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
from gyre_traj.records import Call, Delta, Role
from tokenizers import Tokenizer

from gyre_proxy.bodycache import BodyCache
from gyre_proxy.chat import Conversation, Sampling, Turn
from gyre_proxy.classify import classify
from gyre_proxy.config import ProxyConfig
from gyre_proxy.engines import EnginePool
from gyre_proxy.exactness import LastCall
from gyre_proxy.generation import Counters, Generation, GenResult
from gyre_proxy.msgcache import MessageCache
from gyre_proxy.render import AgentCache, ContextTooLong, ExecutionCache, Rendered, Renderer
from gyre_proxy.sink import RecordSink, Ticket
from gyre_proxy.stoptext import shown_text
from gyre_proxy.strip import Stripper
from gyre_proxy.toolparse import Block, BlockKind, parse
from gyre_proxy.upstream import UpstreamClient

log = logging.getLogger("gyre_proxy")
INLINE_BYTES = 64 * 1024
"""Requests up to this many bytes may be handled on the event loop (`Proxy.owned`): their work is bounded
by that size, and they then take no turn of the loop to go to the worker thread and back."""
KEPT_BODY_BYTES = INLINE_BYTES
"""Anthropic request bodies over this many bytes are kept (`Proxy.bodies`), so the next call that resends
their messages decodes only its new ones; smaller ones are decoded whole each time, which costs them less
than the keeping."""
EXTENDS = "extends"
"""Record metadata key: the call this one extends (gyre-traj's `Call.metadata` documents it)."""
ENGINES = "engines"
"""Record metadata key: the ids of the engines that served the call, in order, comma-separated."""
CACHED_TOKENS = "cached_tokens"
"""Record metadata key: input tokens the call's first engine took from its prefix cache."""


def load_tokenizer(path: str) -> Tokenizer:
    p = path
    if os.path.isdir(p):
        p = os.path.join(p, "tokenizer.json")
    if not os.path.exists(p):
        raise FileNotFoundError(f"no tokenizer.json at {path!r}")
    return Tokenizer.from_file(p)


def lcp(a: np.ndarray, b: np.ndarray | None) -> int:
    if b is None:
        return 0
    n = min(a.size, b.size)
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


@dataclass
class CallStats:
    added_ms: deque[float] = field(default_factory=lambda: deque(maxlen=10000))
    calls: int = 0
    reused_tokens: int = 0
    recorded_tokens: int = 0
    tokenized_tokens: int = 0
    ambiguous_turns: int = 0  # assistant turns with several recorded candidates (tokenized instead)
    appended_calls: int = 0  # recorded calls whose harness only appended to the agent's last call
    non_extensions: int = 0  # of those, calls whose input did not extend that call's input + output
    restored_empty_replies: int = 0  # empty replies the harness dropped, put back
    abandoned_calls: int = 0  # calls whose client left before their answer was ready (nothing recorded)
    records_unanswered: int = 0  # calls recorded whose client left before the response completed


class Proxy:
    def __init__(self, cfg: ProxyConfig, tokenizer: Tokenizer | None = None) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer or load_tokenizer(cfg.tokenizer)
        self.renderer = Renderer(self.tokenizer)
        self.executions: OrderedDict[str, ExecutionCache] = OrderedDict()
        self._hot: OrderedDict[str, None] = OrderedDict()  # executions whose render caches are kept
        self.counters = Counters()
        self.stats = CallStats()
        self._seq = itertools.count()
        self._salt = secrets.token_hex(3)
        self.stripper = Stripper(cfg.strip_rules)
        self.messages = MessageCache(cfg.decoded_cache_bytes)  # decoded request messages (the state lock)
        # the most recent decoded requests of each execution (the state lock)
        self.bodies: BodyCache[Any] = BodyCache(cfg.decoded_bodies_bytes)
        self.pool: EnginePool | None = None
        self.http: UpstreamClient | None = None
        self.sink: RecordSink | None = None
        # The render caches, the recorded outputs and the call counters are touched only under
        # `_state`. A request's work that grows with it (decoding, checks, rendering, tokenizing, building
        # the record) runs on the worker thread; a small request's (at most INLINE_BYTES) runs on the event
        # loop when the worker does not hold the state at that moment, so it takes no turn of the loop.
        self._worker: ThreadPoolExecutor | None = None
        self._state = threading.Lock()
        self._queued = 0  # jobs submitted to the worker and not done (counted on the event loop)

    def owned[T](self, size: int, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """`fn(*args)` holding the proxy's state, for a request of `size` bytes: here and now (a done
        future: awaiting it takes no turn of the loop) if it is small and nothing waits for the worker,
        else on the worker thread; either way after everything submitted before it."""
        if size <= INLINE_BYTES and not self._queued and self._state.acquire(blocking=False):
            done: asyncio.Future[T] = asyncio.get_running_loop().create_future()
            try:
                done.set_result(fn(*args))
            except Exception as exc:
                done.set_exception(exc)
            finally:
                self._state.release()
            return done
        assert self._worker is not None, "the proxy is not started"
        self._queued += 1  # while anything waits for the worker, later work goes behind it (in order)
        fut = asyncio.get_running_loop().run_in_executor(self._worker, self._holding, fn, args)
        fut.add_done_callback(self._dequeued)
        return fut

    def _dequeued(self, fut: asyncio.Future[Any]) -> None:
        self._queued -= 1

    def _holding[T](self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        with self._state:
            return fn(*args)

    def after_written(self, size: int, fn: Callable[[Call], None], rec: Call) -> None:
        """`owned(size, fn, rec)`, not waited for (on the worker it runs before anything queued after
        it); a failure is logged."""
        self.owned(size, fn, rec).add_done_callback(_log_failure)

    async def start(self) -> None:
        # One pool of kept-alive connections for the engines' streams and aborts (`upstream.py`): no cap
        # on the connections in use (the calls in flight bound them, one engine stream per call).
        tls = ssl.create_default_context()  # made once: each takes milliseconds, and engines may use https
        self.http = UpstreamClient(
            timeout_s=self.cfg.request_timeout_s, connect_timeout_s=5.0, max_keepalive=512, ssl_context=tls
        )
        self.pool = EnginePool(
            self.cfg.drain_grace_s,
            self.cfg.request_timeout_s,
            retry_s=self.cfg.engine_retry_s,
            retry_max_s=self.cfg.engine_retry_max_s,
            session_idle_s=self.cfg.session_idle_s,
            http=self.http,
        )
        self.sink = RecordSink(self.cfg.record_log or None, self.cfg.record_push, token=self.cfg.token)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="gyre-proxy-worker")
        for i, url in enumerate(self.cfg.engines):
            self.pool.add(i, url)

    async def stop(self) -> None:
        if self.pool is not None:
            await self.pool.aclose()
        if self.http is not None:
            await self.http.aclose()
        if self._worker is not None:
            await asyncio.to_thread(self._worker.shutdown)
        if self.sink is not None:
            await asyncio.to_thread(self.sink.close)

    def execution(self, ex_id: str) -> ExecutionCache:
        """The execution's cache. The `max_executions` most recent keep their render caches; older ones
        keep only their recorded outputs (small), up to 16x as many, so their ids stay exact."""
        ex = self.executions.get(ex_id)
        if ex is None:
            ex = self.executions[ex_id] = ExecutionCache()
            while len(self.executions) > 16 * self.cfg.max_executions:
                self.executions.popitem(last=False)
        else:
            self.executions.move_to_end(ex_id)
        self._hot[ex_id] = None
        self._hot.move_to_end(ex_id)
        while len(self._hot) > self.cfg.max_executions:
            cold, _ = self._hot.popitem(last=False)
            if cold in self.executions:
                self.executions[cold].forget_renders()
        return ex

    def client_left(self, run: CallRun) -> None:
        """Account for a call whose client disconnected before its response completed. Before its record
        was queued nothing of it is kept (the engine request was aborted, and no record is queued from
        now on); after, the record stays (it is durable before the response can complete) and is counted
        and logged, never silent."""
        if run.client_left():
            self.stats.records_unanswered += 1
            log.warning(
                "call %s of %s: recorded, but its client left before the response completed",
                run.call_id,
                run.ex_id,
            )
        else:
            self.stats.abandoned_calls += 1

    def count_tokens(self, conv: Conversation, ex_id: str) -> int:
        """Input tokens of `conv` (holding the state); one that cannot fit the context is `ContextTooLong`."""
        rendered, _ = self.renderer.render(conv, self.execution(ex_id), limit=self.cfg.max_context_tokens)
        return rendered.n_tokens

    def non_extensions_by_execution(self) -> dict[str, int]:
        """Executions with non-extensions, and how many (holding the state)."""
        return {k: v.non_extensions for k, v in self.executions.items() if v.non_extensions}

    def start_call(
        self,
        conv: Conversation,
        sampling: Sampling,
        ex_id: str,
        headers: Mapping[str, str],
        t0: float | None = None,
        size: int = 0,
    ) -> CallRun:
        """Classify and render a call (holding the state: `owned`). `t0`: when the request body was in hand
        (perf_counter), for the added-latency figure."""
        t0 = time.perf_counter() if t0 is None else t0
        ex = self.execution(ex_id)
        role, agent = classify(conv, headers, self.cfg.agent_headers)
        last = ex.last_calls.get(agent)
        sent = conv.turns
        if last is not None:
            conv, restored = last.restore(conv)
            self.stats.restored_empty_replies += restored
        extends = last if last is not None and last.only_appended(conv) else None
        limit = self.cfg.max_context_tokens
        if self.cfg.incremental:
            rendered, ac = self.renderer.render(conv, ex, agent, limit)
        else:
            rendered, ac = self.renderer.render_full(conv, limit), ex.agent(self.renderer.agent_key(conv), 16)
        n = rendered.n_tokens
        if n >= limit:
            raise ContextTooLong(n, limit, at_least=False)
        max_new = max(
            1, min(sampling.max_new_tokens, self.cfg.max_new_tokens_cap, self.cfg.max_context_tokens - n)
        )
        if max_new != sampling.max_new_tokens:
            sampling = msgspec.structs.replace(sampling, max_new_tokens=max_new)
        call_id = f"c{next(self._seq):07d}{self._salt}"
        self.stats.calls += 1
        self.stats.reused_tokens += rendered.reused_tokens
        self.stats.recorded_tokens += rendered.recorded_tokens
        self.stats.tokenized_tokens += rendered.tokenized_tokens
        self.stats.ambiguous_turns += rendered.ambiguous
        ident = CallIdentity(role, agent, call_id, extends, sent)
        return CallRun(self, conv, sampling, ex_id, ex, ac, rendered, ident, t0, size)


@dataclass(frozen=True)
class CallIdentity:
    role: Role
    agent: str
    call_id: str
    extends: LastCall | None  # the agent's last call, when the harness only appended to it
    sent: tuple[Turn, ...]  # the turns as the harness sent them (before empty replies were put back)


class IncrementalText:
    """Decoded text of a growing list of output ids, decoding only the ids not yet committed: a prefix is
    committed once its text ends on a whole character (byte-level BPE splits characters across tokens)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        self.n = 0
        self.done = ""

    def text(self, ids: list[int]) -> str:
        tail = str(self.tok.decode(ids[self.n :], skip_special_tokens=False))
        if tail and not tail.endswith("\ufffd"):
            self.done += tail
            self.n = len(ids)
            return self.done
        return self.done + tail


class CallRun:
    """One call in progress; the API layer iterates `blocks()` then awaits `finish()`."""

    def __init__(
        self,
        proxy: Proxy,
        conv: Conversation,
        sampling: Sampling,
        ex_id: str,
        ex: ExecutionCache,
        ac: AgentCache,
        rendered: Rendered,
        ident: CallIdentity,
        t0: float,
        size: int = 0,
    ) -> None:
        self.proxy = proxy
        self.conv = conv
        self.sampling = sampling
        self.ex_id = ex_id
        self.ex = ex
        self.ac = ac
        self.rendered = rendered
        self.role = ident.role
        self.agent = ident.agent
        self.call_id = ident.call_id
        self.extends = ident.extends
        self.sent = ident.sent
        self.t0 = t0
        self.size = size  # the request's bytes (small ones are finished on the event loop: `Proxy.owned`)
        self.t_wall = time.time()
        self.input_ids = rendered.ids()
        self.input_json = rendered.ids_json()
        self.result = GenResult()
        self.final_blocks: list[Block] = []
        self.text = ""
        self.recorded = False  # the record was handed to the log (it lands even if the client leaves)
        self._left = False  # the client went away (set on the loop, read by the worker under the lock)
        self._left_lock = threading.Lock()

    @property
    def n_input(self) -> int:
        return int(self.input_ids.size)

    @property
    def signature(self) -> str:
        return f"gyre:{self.call_id}"

    def tool_id(self, index: int) -> str:
        return f"toolu_{self.call_id}_{index}"

    def decode(self, ids: list[int]) -> str:
        return str(self.proxy.tokenizer.decode(ids, skip_special_tokens=False))

    async def blocks(self) -> AsyncIterator[list[Block]]:
        """Parsed output so far after each engine chunk (held back where a tag or a stop sequence may still
        be growing; the text ends before a stop sequence)."""
        p = self.proxy
        assert p.pool is not None and p.http is not None
        gen = Generation(
            p.pool,
            p.http,
            p.counters,
            f"{self.ex_id}/{self.call_id}",
            self.ex_id,
            self.input_ids,
            self.input_json,
            self.sampling,
            pick_wait_s=p.cfg.pick_wait_s,
            stream_interval=p.cfg.stream_interval,
            kv_transport=p.cfg.kv_transport,
        )
        self.result = gen.result
        detok = IncrementalText(p.tokenizer)
        stops = self.sampling.stop  # the APIs leave a stop string out of the text (not out of the record)
        async for _ in gen.stream():
            yield parse(shown_text(detok.text(gen.result.output_ids), stops, final=False), final=False)
        self.text = shown_text(self.decode(gen.result.output_ids), stops, final=True)
        self.final_blocks = parse(self.text, final=True)

    async def run(self) -> list[Block]:
        async for _ in self.blocks():
            pass
        return self.final_blocks

    @property
    def stop_reason(self) -> str:
        """ "tool_use", "max_tokens" or "end_turn"."""
        if any(b.kind is BlockKind.TOOL for b in self.final_blocks):
            return "tool_use"
        if self.result.matched and self.result.matched in self.sampling.stop:
            return "stop_sequence"
        return "max_tokens" if self.result.finish == "length" else "end_turn"

    async def finish(self) -> Call:
        """Remember the output for later renders and write the record (returns once it is on disk). The
        record is built and queued to the log in one `owned` step, so this waits once, for the log; the
        agent's last call is updated after that, unawaited but ahead of any later call's render."""
        p = self.proxy
        loop = asyncio.get_running_loop()
        written: asyncio.Future[None] = loop.create_future()
        box: list[Any] = []  # the record, then the log's ticket for it
        queued = p.owned(self.size, self._record_and_queue, loop, written, box)
        try:
            if queued.done() and len(box) == 2:  # queued here and now (a small request)
                # One turn of the loop, and the record is most likely on disk by then: the ticket says
                # so without the two more turns `written` takes to wake this task from the writer thread.
                await asyncio.sleep(0)
                ticket: Ticket = box[1]
                if not ticket.settled:
                    await written
                else:
                    written.cancel()  # settled: nobody reads `written` (its error would go unretrieved)
                    if ticket.error is not None:
                        raise ticket.error
            else:
                await written
        finally:
            queued.cancel()  # nothing waits for it: `written` says all (a failure there fails `written`)
        rec = box[0]
        # the proxy's own time for this call: the body in hand to the record on disk, less the engine's
        p.stats.added_ms.append((time.perf_counter() - self.t0 - self.result.engine_s) * 1000.0)
        p.after_written(self.size, self._written, rec)
        return rec

    def _record_and_queue(
        self, loop: asyncio.AbstractEventLoop, written: asyncio.Future[None], box: list[Any]
    ) -> None:
        """(holding the state) Keep the output for later renders, build the record and queue it to the log,
        unless the client already left (then nothing is queued)."""
        try:
            rec = self._recorded_output()
        except Exception as exc:  # the call fails with it (a 500, the traceback in the log)
            loop.call_soon_threadsafe(_fail, written, exc)
            return
        box.append(rec)
        with self._left_lock:
            if self._left:  # nobody waits for `written` any more
                loop.call_soon_threadsafe(written.cancel)
                return
            assert self.proxy.sink is not None
            box.append(self.proxy.sink.submit_for(rec, loop, written))
            self.recorded = True  # queued: the writer thread writes it, whatever happens to the call now

    def client_left(self) -> bool:
        """(event loop) The client went away: from now on nothing is queued. Whether it was already."""
        with self._left_lock:
            self._left = True
            return self.recorded

    def _recorded_output(self) -> Call:
        """(holding the state) Keep the output for later renders; the call's record."""
        p = self.proxy
        out = np.asarray(self.result.output_ids, np.int32)
        tools = [self.tool_id(i) for i, b in enumerate(self.final_blocks) if b.kind is BlockKind.TOOL]
        text = "".join(b.text for b in self.final_blocks if b.kind is BlockKind.TEXT)
        has_thinking = any(b.kind is BlockKind.THINKING for b in self.final_blocks)
        p.renderer.record_output(
            self.ex,
            self.call_id,
            self.rendered.gen_prompt,
            out,
            tools,
            self.signature if has_thinking else "",
            text,
            agent=self.agent,
            context=self.rendered.context,
            position=len(self.conv.turns),
        )
        return self._record(out)

    def _written(self, rec: Call) -> None:
        """(holding the state) The record is on disk: this call is now its agent's last call."""
        p = self.proxy
        out = rec.output_ids
        self._count_extension()
        full = np.concatenate([self.input_ids, out])
        self.ac.last_call_id, self.ac.last_full = self.call_id, full
        c = self.conv
        empty = not self.final_blocks
        last = LastCall(self.call_id, c.system, c.tools_json, self.sent, c.turns, full, empty)
        self.ex.remember(self.agent, last, p.renderer.max_agents)

    def _metadata(self) -> dict[str, str]:
        """The record's metadata: harness metadata stripped from the prompt, the call this one extends,
        the engines that served it (`engines`: ids in order, comma-separated; a moved call names several)
        and the input tokens its first engine found in its prefix cache (`cached_tokens`)."""
        meta: dict[str, str] = {}
        if self.result.engines:
            meta[ENGINES] = ",".join(map(str, self.result.engines))
            meta[CACHED_TOKENS] = str(self.result.cached_tokens)
        for name, text in self.conv.stripped:
            key = f"stripped.{name}"
            meta[key] = f"{meta[key]}\n\n{text}" if key in meta else text
        if self.extends is not None:
            meta[EXTENDS] = self.extends.call_id
        return meta

    def _count_extension(self) -> None:
        """Where the harness only appended, count (and log) an input that does not extend the last call."""
        prev = self.extends
        if prev is None:
            return
        stats = self.proxy.stats
        stats.appended_calls += 1
        if not prev.extended_by(self.input_ids):
            stats.non_extensions += 1
            self.ex.non_extensions += 1
            log.warning(
                "call %s of %s/%s does not extend call %s although the harness only appended to it",
                self.call_id,
                self.ex_id,
                self.agent,
                prev.call_id,
            )

    def _record(self, out: np.ndarray) -> Call:
        """The TITO record, its input delta-encoded against the agent's last call (else the last call
        with the same system and tools)."""
        last = self.ex.last_calls.get(self.agent)
        parent, base = (
            (last.call_id, last.full) if last is not None else (self.ac.last_call_id, self.ac.last_full)
        )
        keep = lcp(self.input_ids, base) if parent else 0
        common = dict(
            execution_id=self.ex_id,
            call_id=self.call_id,
            agent_id=self.agent,
            role=self.role,
            output_ids=out,
            output_logprobs=np.asarray(self.result.logprobs, np.float32),
            weight_version=self.result.weight_version,
            finish_reason=self.result.finish,
            t_start=self.t_wall,
            t_end=time.time(),
            metadata=self._metadata(),
        )
        if keep > 0:
            return Call(input_delta=Delta(parent, keep, self.input_ids[keep:]), **common)  # type: ignore[arg-type]
        return Call(input_ids=self.input_ids, **common)  # type: ignore[arg-type]


def _fail(fut: asyncio.Future[None], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def _log_failure(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("bookkeeping after a record was written failed", exc_info=fut.exception())
