"""Export/import of a cached prefix between two in-process engines (and once over HTTP): the importing
engine continues exactly as a fresh prefill would, without computing the imported tokens."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from gyre_engine.client import EngineClient, EngineError
from gyre_engine.protocol import KV_PREFIX_DECODER, KV_PREFIX_ENCODER, SamplingParams

torch = pytest.importorskip("torch")
from gyre_engine.server.engine import Engine  # noqa: E402
from gyre_engine.server.kv_transfer import KvTransferError, export_prefix, import_prefix  # noqa: E402
from gyre_engine.server.request import EngineRequest, TokenEvent  # noqa: E402
from gyre_engine.server.serve import ServeConfig, load_engine  # noqa: E402

SYSTEM = [1000 + i for i in range(40)]
USER = [1200 + i * 7 for i in range(9)]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


def generate(engine: Engine, ids: list[int], rid: str) -> tuple[list[int], int]:
    """Run one request to completion on an in-process engine; returns (output ids, cached tokens)."""
    out: list[int] = []
    cached = [0]
    done = threading.Event()

    def sink(ev: TokenEvent) -> None:
        out.extend(ev.token_ids)
        cached[0] = ev.cached_tokens
        if ev.finish is not None:
            done.set()

    engine.submit(EngineRequest(rid, ids, GREEDY), sink).result(30)
    assert done.wait(60)
    return out, cached[0]


@pytest.fixture(scope="module")
def engines(model_dir: Path) -> Iterator[tuple[Engine, Engine]]:
    a = load_engine(ServeConfig(model=str(model_dir), device="cpu"))
    b = load_engine(ServeConfig(model=str(model_dir), device="cpu"))
    yield a, b
    a.shutdown()
    b.shutdown()


def test_imported_prefix_continues_like_a_fresh_prefill(engines: tuple[Engine, Engine]) -> None:
    a, b = engines
    first, _ = generate(a, SYSTEM + USER, "first")
    context = SYSTEM + USER + first + USER[:4]  # the agent's next call
    rec = a.call(export_prefix, a, context).result(30)
    assert rec is not None and rec.token_ids == (SYSTEM + USER + first)[:-1]
    wire = KV_PREFIX_ENCODER.encode(rec)  # what a transport carries: msgpack with raw array bytes
    b.call(b.flush_cache).result(30)
    fresh, fresh_cached = generate(b, context, "fresh")
    assert fresh_cached == 0
    b.call(b.flush_cache).result(30)
    before = b.stats().prefill_tokens_computed
    assert b.call(import_prefix, b, KV_PREFIX_DECODER.decode(wire)).result(30) == len(rec.token_ids)
    cont, cached = generate(b, context, "imported")
    assert cached == len(rec.token_ids)
    assert b.stats().prefill_tokens_computed - before == len(context) - cached
    assert cont == fresh


def test_bad_records_are_refused(engines: tuple[Engine, Engine]) -> None:
    a, b = engines
    generate(a, SYSTEM, "seed")
    rec = a.call(export_prefix, a, SYSTEM).result(30)
    assert rec is not None
    bad = [
        (msgspec.structs.replace(rec, version=99), "protocol version"),
        (msgspec.structs.replace(rec, model_fingerprint="x"), "another shape"),
        (msgspec.structs.replace(rec, weight_version="7"), "weight_version"),
        (msgspec.structs.replace(rec, keys=rec.keys[:1]), "layers"),
        (msgspec.structs.replace(rec, token_ids=rec.token_ids[:-1]), "positions"),
        (msgspec.structs.replace(rec, keys=[k[:-2] for k in rec.keys]), "bytes"),
    ]
    for r, needle in bad:
        with pytest.raises(KvTransferError, match=needle):
            b.call(import_prefix, b, r).result(30)
    assert a.call(export_prefix, a, [5, 6, 7]).result(30) is None


def test_export_and_import_over_http(server: Any) -> None:
    async def go() -> None:
        async with EngineClient(server.url, timeout_s=60) as c:
            await c.flush_cache()
            first = await c.generate(SYSTEM, GREEDY)
            context = SYSTEM + first.output_ids + USER
            rec = await c.export_prefix(context)
            assert rec is not None and len(rec.token_ids) == len(SYSTEM) + len(first.output_ids) - 1
            await c.flush_cache()
            fresh = await c.generate(context, GREEDY)
            await c.flush_cache()
            assert (await c.import_prefix(rec)).success
            again = await c.generate(context, GREEDY)
            assert again.meta_info.cached_tokens == len(rec.token_ids)
            assert again.output_ids == fresh.output_ids
            assert await c.export_prefix([3, 2, 1]) is None
            with pytest.raises(EngineError, match="weight_version"):
                await c.import_prefix(msgspec.structs.replace(rec, weight_version="other"))

    asyncio.run(go())
