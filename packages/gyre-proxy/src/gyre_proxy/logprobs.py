"""OpenAI `logprobs.content` entries from what a call recorded: one entry per sampled output token (the
thinking, tool-call markup and end token included: they are what the policy sampled), each with its
logprob, its text, its raw bytes and, when asked, the engine's top alternatives at that position.

Bytes come from the byte-level BPE alphabet (GPT-2's byte-to-unicode table, which Qwen's tokenizer uses),
so a token that holds part of a UTF-8 character reports the bytes it really holds.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from tokenizers import Tokenizer


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's reversible map from bytes to printable characters, inverted."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(keep)
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


def token_bytes(tok: Tokenizer, token_id: int) -> bytes:
    piece = tok.id_to_token(token_id) or ""
    dec = _byte_decoder()
    if piece and all(c in dec for c in piece):
        return bytes(dec[c] for c in piece)
    return str(tok.decode([token_id], skip_special_tokens=False)).encode()


def _entry(tok: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    raw = token_bytes(tok, token_id)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}


def content_logprobs(
    tok: Tokenizer, ids: list[int], logprobs: list[float], tops: list[list[tuple[float, int]]]
) -> list[dict[str, Any]]:
    out = []
    for k, (tid, lp) in enumerate(zip(ids, logprobs, strict=True)):
        e = _entry(tok, tid, lp)
        e["top_logprobs"] = [_entry(tok, t, v) for v, t in tops[k]] if k < len(tops) else []
        out.append(e)
    return out
