"""Decoded request messages by their exact bytes, so the history a harness sends again on every call is
decoded, checked and converted once.

A content-addressed LRU: the key is a message's raw JSON text, the value what decoding, checking and
converting it gave (both pure functions of those bytes), so a hit changes nothing but the cost. Its keys
are bounded in total bytes (`ProxyConfig.decoded_cache_bytes`); the values hold about as much again.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class MessageCache:
    """Raw message bytes -> (decoded message, its turns); not thread-safe (the proxy's state lock)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, tuple[Any, tuple[Any, ...]]] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, key: bytes) -> tuple[Any, tuple[Any, ...]] | None:
        hit = self._entries.get(key)
        if hit is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return hit

    def put(self, key: bytes, message: Any, turns: tuple[Any, ...]) -> None:
        if len(key) > self.max_bytes or key in self._entries:
            return
        self._entries[key] = (message, turns)
        self._bytes += len(key)
        while self._bytes > self.max_bytes:
            old, _ = self._entries.popitem(last=False)
            self._bytes -= len(old)

    def __len__(self) -> int:
        return len(self._entries)
