"""A call's cached prefix (its KV) taken from one engine and put into another, so the next engine does
not prefill it again.

Two steps, because the first must happen while the old engine still holds the KV (a drain waits for it)
and the second once the next engine is known: `take_out` asks the old engine for the prefix, `put_in`
installs it in the new one. The way is the pool's `kv_transport`: "shm" or "mooncake" hand the KV over
gyre-xfer (`/offer_prefix` copies it into an offer pool that outlives the engine's own memory, the new
engine pulls it with `/import_prefix_xfer`, the receipt frees it), "cuda_ipc" the same with the pool a
buffer in the old engine's GPU memory that the new engine copies from device to device (an engine on
another GPU refuses it: the call is prefilled), "http" carries it as a `KvPrefix` in HTTP bodies
(`/export_prefix`, `/import_prefix`). An engine without these endpoints (SGLang: 404, 405)
is not asked again; any failure means the next engine prefills the prefix itself, which is always exact.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import cast

import httpx
import msgspec
from gyre_engine.client import EngineError
from gyre_engine.protocol import KvPrefix, PrefixOffer, Transport

from gyre_proxy.engines import Engine, EngineState

log = logging.getLogger("gyre_proxy.kvmove")

MOVE_TIMEOUT_S = 30.0
"""Longest wait on an engine's answer to a prefix offer, export or import (then the call re-prefills)."""
_FAILURES = (httpx.HTTPError, EngineError, TimeoutError, msgspec.MsgspecError)


@dataclass
class Carried:
    """A prefix taken out of `source`: an open gyre-xfer offer, or the KV itself."""

    source: Engine
    offer: PrefixOffer | None = None
    record: KvPrefix | None = None
    out_s: float = 0.0

    @property
    def tokens(self) -> int:
        if self.offer is not None:
            return len(self.offer.token_ids)
        return len(self.record.token_ids) if self.record is not None else 0


async def take_out(old: Engine, ids: list[int], transport: str) -> Carried | None:
    """The cached prefix of `ids` on `old` (a gyre-engine that is not removed), else None."""
    if old.state is EngineState.REMOVED or old.supports_prefix_export is False:
        return None
    t0 = time.perf_counter()
    try:
        if transport == "http":
            rec = await old.client.export_prefix(ids, timeout=MOVE_TIMEOUT_S)
            got = None if rec is None else Carried(old, record=rec)
        else:
            offer = await old.client.offer_prefix(
                ids, transport=cast(Transport, transport), timeout=MOVE_TIMEOUT_S
            )
            got = None if offer is None else Carried(old, offer=offer)
    except _FAILURES as exc:
        log.info("prefix from engine %d not taken out (%r); the next engine prefills it", old.engine_id, exc)
        if isinstance(exc, EngineError) and exc.status in (404, 405):
            old.supports_prefix_export = False
        return None
    old.supports_prefix_export = True
    if got is not None:
        got.out_s = time.perf_counter() - t0
    return got


async def put_in(carried: Carried | None, new: Engine) -> int:
    """Install a taken-out prefix in `new`; the tokens it covers there (0: the call prefills them). An
    offer is released on its source whatever happens (it also expires after its lease). A call that goes
    back to the engine it left installs nothing (0): that engine's prefix cache still holds the prefix,
    and an engine cannot open its own CUDA IPC offer."""
    if carried is None:
        return 0
    if new is carried.source:
        await _release(carried, [])
        return 0
    try:
        if carried.record is not None:
            await new.client.import_prefix(carried.record, timeout=MOVE_TIMEOUT_S)
            return carried.tokens
        assert carried.offer is not None
        arrived: list[int] = []
        try:
            reply = await new.client.import_prefix_xfer(carried.offer, timeout_s=MOVE_TIMEOUT_S)
            arrived = [b.src_block for b in reply.blocks if b.status == "OK"]
            return int(reply.tokens) if reply.success else 0
        finally:
            await _release(carried, arrived)
    except _FAILURES as exc:
        log.info("prefix not installed in engine %d (%r); it prefills it", new.engine_id, exc)
        return 0


async def _release(carried: Carried, arrived: list[int]) -> None:
    """Free the offer on its source engine (if it is one, and the engine is still there)."""
    if carried.offer is None or carried.source.state is EngineState.REMOVED:
        return
    with contextlib.suppress(*_FAILURES):
        await carried.source.client.release_prefix_offer(carried.offer.offer_id, arrived=arrived)
