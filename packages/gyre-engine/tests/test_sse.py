"""`gyre_engine.sse.data_fields` splits SGLang's event stream at LF only: a JSON string holding a character
that `str.splitlines` treats as a line break (U+2028, U+2029, U+0085, U+001C-U+001E) stays whole, however
the bytes are cut into chunks (httpx's `aiter_lines` cut such a chunk in two)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
from gyre_engine.sse import data_fields
from hypothesis import given
from hypothesis import strategies as st

BREAKERS = "\u2028\u2029\x85\x1c\x1d\x1e\x0b\x0c\r"
_texts = st.text(alphabet=st.sampled_from(list(BREAKERS)) | st.characters(codec="utf-8"), max_size=12)


async def _collect(chunks: list[bytes]) -> list[bytes]:
    async def gen() -> AsyncIterator[bytes]:
        for c in chunks:
            yield c

    return [d async for d in data_fields(gen())]


def _cut(raw: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(raw)) for c in cuts})
    return [raw[a:b] for a, b in zip([0, *points], [*points, len(raw)], strict=True)]


@given(st.lists(_texts, min_size=1, max_size=5), st.lists(st.integers(0, 400), max_size=12), st.booleans())
def test_each_event_comes_back_whole_however_the_stream_is_cut(
    texts: list[str], cuts: list[int], crlf: bool
) -> None:
    eol = "\r\n" if crlf else "\n"
    events = [json.dumps({"text": t, "meta_info": {"id": t}}, ensure_ascii=False) for t in texts]
    raw = "".join(f": keep-alive{eol}data: {e}{eol}{eol}" for e in [*events, "[DONE]"]).encode()
    got = asyncio.run(_collect(_cut(raw, cuts)))
    assert got == [e.encode() for e in [*events, "[DONE]"]]
    assert [json.loads(g) for g in got[:-1]] == [{"text": t, "meta_info": {"id": t}} for t in texts]


def test_httpx_aiter_lines_would_have_cut_the_event() -> None:
    # the behaviour this module exists for (if httpx ever splits at LF only, sse.py can go)
    event = json.dumps({"text": "a\u2028b"}, ensure_ascii=False)
    response = httpx.Response(200, content=f"data: {event}\n".encode())

    async def lines() -> list[str]:
        return [line async for line in response.aiter_lines()]

    assert asyncio.run(lines()) == ['data: {"text": "a', 'b"}']
    assert asyncio.run(_collect([f"data: {event}\n".encode()])) == [event.encode()]
