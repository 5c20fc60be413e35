"""The set of rollout engines the proxy routes to: session affinity, least outstanding work, rebalancing,
drain, remove.

An execution stays on the engine it first went to (its prefix cache lives there) while that engine takes
requests; otherwise the active engine with the least outstanding work (tokens of in-flight calls) gets it.
Affinity alone would leave an engine that joins late, or comes back from training, with nothing to do
while the executions it lost stay elsewhere: so between two calls of an execution (`rebalance`), it moves
to the engine with the fewest live executions (a call within `session_idle_s`) when its own engine has at
least two more, and its cached prefix goes along (`kvmove.py`).
Draining an engine stops new calls; after `drain_grace_s` its in-flight calls are aborted and continued on
another engine by their owners (`Generation`), and `on_drained` fires once none is left. Removing an engine
makes its in-flight calls continue elsewhere at once; only the scheduler removes one (`EngineRemove`). An
engine a connection to failed is only set aside (FAILED): its `/health` is polled with exponential backoff
and it takes requests again as soon as it answers 200; the probes go through the engine client's own
probe pool, which no load (calls, aborts, prefix moves) can fill.

A call whose client left has its engine request aborted (`abort_soon`): a task of its own, bounded by a
timeout, at most `ABORT_SLOTS` at once per engine, sent through the proxy's own HTTP/1.1 client
(`upstream.py`), whose connection is closed whenever a request is left before its answer's end, so an
abort cut short by its timeout or by the proxy stopping leaves no connection behind (an httpx pool's
timeout is a cancellation inside httpcore, which can leave the connection it had assigned to the garbage
collector). `aclose` stops the aborts still queued and waits for them before it returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import msgspec
from gyre_engine.client import EngineClient
from gyre_engine.protocol import AbortRequest

from gyre_proxy.upstream import UpstreamClient

log = logging.getLogger("gyre_proxy.engines")
ABORT_SLOTS = 16
"""Aborts in flight at once per engine; more wait their turn (within their timeout)."""
STOP_WAIT_S = 5.0
"""How long `EnginePool.aclose` waits for its cancelled tasks to end."""


class EngineState(enum.StrEnum):
    ACTIVE = "active"
    DRAINING = "draining"
    FAILED = "failed"  # a connection failed: not routed to until its health check answers
    REMOVED = "removed"


@dataclass(eq=False)
class InFlight:
    """One running /generate on an engine; `move` set means: abort it and continue elsewhere (its owner,
    reading the engine's stream, learns it through `wake`)."""

    rid: str
    execution: str
    work: int
    move: asyncio.Event = field(default_factory=asyncio.Event)
    wake: Callable[[], None] | None = None

    def request_move(self) -> None:
        """Tell the call's owner to abort this attempt and continue elsewhere."""
        if not self.move.is_set():
            self.move.set()
            if self.wake is not None:
                self.wake()


@dataclass(eq=False)
class Engine:
    engine_id: int
    url: str
    client: EngineClient
    state: EngineState = EngineState.ACTIVE
    in_flight: set[InFlight] = field(default_factory=set)
    outstanding: int = 0  # tokens of in-flight calls (input not yet cached + max new tokens)
    served: int = 0
    failures: int = 0  # times it was set aside after a connection failure
    revived: int = 0  # times it came back after one
    supports_prefix_export: bool | None = None  # learnt on first try
    abort_slots: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(ABORT_SLOTS))


class NoEngine(RuntimeError):
    """No engine can take the request now (all draining, removed or none registered)."""


class EnginePool:
    """Engines by id; every method runs on the proxy's event loop."""

    def __init__(
        self,
        drain_grace_s: float = 0.0,
        request_timeout_s: float = 600.0,
        on_drained: Callable[[int], Awaitable[None]] | None = None,
        retry_s: float = 0.2,
        retry_max_s: float = 5.0,
        session_idle_s: float = 30.0,
        http: UpstreamClient | None = None,
    ) -> None:
        """`retry_s`: first wait before a failed engine's health check, doubling up to `retry_max_s`;
        `session_idle_s`: an execution without a call for this long no longer counts as live on its engine
        (0: no rebalancing); `http`: the client aborts go through (the caller closes it after `aclose`;
        default: one of the pool's own)."""
        self.engines: dict[int, Engine] = {}
        self.affinity: dict[str, int] = {}
        self.last_call: dict[str, float] = {}
        """Execution -> when its last call was routed (event-loop time)."""
        self.session_idle_s = session_idle_s
        self.rebalanced = 0
        """Executions moved to a less loaded engine between two of their calls."""
        self.drain_grace_s = drain_grace_s
        self.request_timeout_s = request_timeout_s
        self.on_drained = on_drained
        self.retry_s = retry_s
        self.retry_max_s = retry_max_s
        self.changed = asyncio.Event()  # set whenever an engine is added, revived or drained
        self.moved_calls = 0
        self.aborts_sent = 0  # engine requests aborted because their caller went away
        self._tasks: set[asyncio.Task[None]] = set()
        self._own_http = http is None
        self.http = UpstreamClient(timeout_s=request_timeout_s) if http is None else http

    # ------------------------------------------------------------------ membership
    def add(self, engine_id: int, url: str) -> Engine:
        old = self.engines.get(engine_id)
        if old is not None and old.url == url and old.state is EngineState.ACTIVE:
            return old
        if old is not None:
            self._retire(old)
        eng = Engine(engine_id, url, EngineClient(url, timeout_s=self.request_timeout_s))
        self.engines[engine_id] = eng
        self._wake()
        log.info("engine %d added at %s", engine_id, url)
        return eng

    def _wake(self) -> None:
        """Tell callers waiting for an engine that one may take requests now."""
        self.changed.set()
        self.changed = asyncio.Event()

    def drain(self, engine_id: int) -> None:
        eng = self.engines.get(engine_id)
        if eng is None:
            self._spawn(self._notify_drained(engine_id))
            return
        if eng.state in (EngineState.ACTIVE, EngineState.FAILED):
            eng.state = EngineState.DRAINING
            log.info("engine %d draining (%d in flight)", engine_id, len(eng.in_flight))
            self._drop_affinity(engine_id)
            self._wake()  # a call waiting to try this engine again picks another, or waits for one
            self._spawn(self._drain(eng))

    def remove(self, engine_id: int, failed: bool = False) -> None:
        eng = self.engines.pop(engine_id, None)
        if eng is not None:
            log.info("engine %d removed (failed=%s, %d in flight)", engine_id, failed, len(eng.in_flight))
            self._retire(eng)

    def _retire(self, eng: Engine) -> None:
        eng.state = EngineState.REMOVED
        self._drop_affinity(eng.engine_id)
        for f in list(eng.in_flight):
            f.request_move()
        self._spawn(eng.client.aclose())

    def mark_dead(self, eng: Engine) -> None:
        """A connection to the engine failed: route around it until its health check answers (only the
        scheduler removes an engine for good)."""
        if self.engines.get(eng.engine_id) is not eng or eng.state is not EngineState.ACTIVE:
            return
        eng.failures += 1
        eng.state = EngineState.FAILED
        self._drop_affinity(eng.engine_id)
        log.warning("engine %d set aside after a connection failure; checking its health", eng.engine_id)
        self._spawn(self._revive(eng))

    async def _revive(self, eng: Engine) -> None:
        delay = self.retry_s
        while self.engines.get(eng.engine_id) is eng and eng.state is EngineState.FAILED:
            await asyncio.sleep(delay)
            if eng.state is not EngineState.FAILED:
                return
            try:
                ok = await eng.client.health(timeout=min(10.0, max(1.0, delay)))
            except RuntimeError:  # its client was closed: the engine was removed meanwhile
                return
            if ok:
                if self.engines.get(eng.engine_id) is eng and eng.state is EngineState.FAILED:
                    eng.state = EngineState.ACTIVE
                    eng.revived += 1
                    log.info("engine %d answers its health check again: taking requests", eng.engine_id)
                    self._wake()
                return
            delay = min(delay * 2, self.retry_max_s)

    def _drop_affinity(self, engine_id: int) -> None:
        for ex in [k for k, v in self.affinity.items() if v == engine_id]:
            del self.affinity[ex]

    async def _drain(self, eng: Engine) -> None:
        if self.drain_grace_s > 0 and eng.in_flight:
            deadline = asyncio.get_running_loop().time() + self.drain_grace_s
            while eng.in_flight and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.02)
        for f in list(eng.in_flight):
            f.request_move()
        while eng.in_flight:
            await asyncio.sleep(0.01)
        await self._notify_drained(eng.engine_id)

    async def _notify_drained(self, engine_id: int) -> None:
        if self.on_drained is not None:
            await self.on_drained(engine_id)

    def _spawn(self, coro: Awaitable[None]) -> asyncio.Task[None]:
        async def run() -> None:
            await coro

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ------------------------------------------------------------------ routing
    def active(self) -> list[Engine]:
        return [e for e in self.engines.values() if e.state is EngineState.ACTIVE]

    def live(self) -> dict[int, int]:
        """Live executions (a call within `session_idle_s`) by the engine they are bound to (an execution
        idle for ten times that is no longer tracked here; its affinity stays)."""
        now = asyncio.get_running_loop().time()
        out: dict[int, int] = {}
        for ex, t in list(self.last_call.items()):
            if now - t > 10 * self.session_idle_s:
                del self.last_call[ex]
            elif now - t <= self.session_idle_s and ex in self.affinity:
                eid = self.affinity[ex]
                out[eid] = out.get(eid, 0) + 1
        return out

    def rebalance(self, execution: str) -> tuple[Engine, Engine] | None:
        """Before an execution's next call: move it from its engine to the active engine with the fewest
        live executions when its own has at least two more (moving one then narrows the gap, never
        reverses it); returns (from, to), or None if it stays."""
        eid = self.affinity.get(execution)
        cur = self.engines.get(eid) if eid is not None else None
        if not self.session_idle_s or cur is None or cur.state is not EngineState.ACTIVE:
            return None
        others = [e for e in self.active() if e is not cur]
        if not others:
            return None
        live = self.live()
        here = live.get(cur.engine_id, 0) + (not self._is_live(execution))
        to = min(others, key=lambda e: (live.get(e.engine_id, 0), e.outstanding, e.engine_id))
        if here - live.get(to.engine_id, 0) < 2:
            return None
        self.affinity[execution] = to.engine_id
        self.rebalanced += 1
        return cur, to

    def _is_live(self, execution: str) -> bool:
        t = self.last_call.get(execution)
        return t is not None and asyncio.get_running_loop().time() - t <= self.session_idle_s

    def pick(self, execution: str, exclude: frozenset[int] = frozenset()) -> Engine:
        self.last_call[execution] = asyncio.get_running_loop().time()
        eid = self.affinity.get(execution)
        if eid is not None and eid not in exclude:
            eng = self.engines.get(eid)
            if eng is not None and eng.state is EngineState.ACTIVE:
                return eng
        cands = [e for e in self.active() if e.engine_id not in exclude] or self.active()
        if not cands:
            raise NoEngine("no rollout engine is taking requests")
        eng = min(cands, key=lambda e: (e.outstanding, len(e.in_flight), e.engine_id))
        self.affinity[execution] = eng.engine_id
        return eng

    async def wait_pick(self, execution: str, wait_s: float, exclude: frozenset[int] = frozenset()) -> Engine:
        """`pick`, waiting up to `wait_s` for an engine to be added when none takes requests."""
        deadline = asyncio.get_running_loop().time() + wait_s
        while True:
            try:
                return self.pick(execution, exclude)
            except NoEngine:
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    raise
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), min(left, 0.05))

    async def wait_for_another(self, exclude: frozenset[int], wait_s: float) -> None:
        """Wait up to `wait_s` while every engine taking requests is in `exclude` (engines that just
        refused a call as unavailable): return at once if another takes requests, early if one is added,
        revived or leaves meanwhile."""
        if any(e.engine_id not in exclude for e in self.active()) or wait_s <= 0:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.changed.wait(), wait_s)

    def abort_soon(self, eng: Engine, rid: str, timeout_s: float) -> asyncio.Future[None]:
        """Tell `eng` to stop `rid`: the abort is a task of its own, so a caller cancelled meanwhile still
        sends it, and `timeout_s` bounds it whole (the wait for a slot included). Failures are logged, not
        raised; the returned future is done once the engine answered or the abort gave up."""
        if eng.state is EngineState.REMOVED:  # its client is closed; nothing runs there for us now
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done
        self.aborts_sent += 1
        body = msgspec.json.encode(AbortRequest(rid=rid))

        async def send() -> None:
            try:
                url = f"{eng.url}/abort_request"
                async with (
                    asyncio.timeout(timeout_s),
                    eng.abort_slots,
                    self.http.stream(url, body, eng.client.headers) as r,
                ):
                    answer = await r.aread()
                if r.status_code >= 400:
                    log.info(
                        "abort of %s on engine %d refused: %d %s",
                        rid,
                        eng.engine_id,
                        r.status_code,
                        answer[:200].decode(errors="replace"),
                    )
            except Exception as exc:  # a dead engine runs nothing; anything else is worth a line
                log.info("abort of %s on engine %d failed: %r", rid, eng.engine_id, exc)

        return self._spawn(send())

    def begin(self, eng: Engine, rid: str, execution: str, work: int) -> InFlight:
        f = InFlight(rid, execution, work)
        eng.in_flight.add(f)
        eng.outstanding += work
        return f

    def end(self, eng: Engine, f: InFlight) -> None:
        if f in eng.in_flight:
            eng.in_flight.discard(f)
            eng.outstanding -= f.work
            eng.served += 1

    async def aclose(self) -> None:
        """Stop what the pool still runs (aborts, health checks) and wait for it, then close the engines'
        clients: nothing opens a connection after this returns."""
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=STOP_WAIT_S)
        for eng in list(self.engines.values()):
            await eng.client.aclose()
        self.engines.clear()
        if self._own_http:
            await self.http.aclose()
