"""The `data:` fields of a server-sent event stream, as SGLang's `/generate` sends it.

Lines end at LF (a CR before it is dropped), as the SSE format says, and nowhere else. httpx's
`aiter_lines` splits the way `str.splitlines` does, also at U+2028, U+2029, U+0085 and U+001C-U+001E,
which JSON leaves unescaped inside strings: a chunk whose text or rid held one of them arrived cut in
two, undecodable (found by gyre-proxy's fuzz tests, with an execution id holding such a character).
Splitting the bytes at b"\\n" cannot cut a UTF-8 character: no byte of a multi-byte one is 0x0A.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator


async def data_fields(chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """Each `data:` line's value (stripped), in order, from the raw bytes of a stream."""
    rest = b""
    async for chunk in chunks:
        if b"\n" not in chunk:
            rest += chunk
            continue
        *lines, rest = (rest + chunk).split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].strip()
    if rest.startswith(b"data:"):  # a last line without its LF
        yield rest[5:].strip()
