"""The most recent decoded requests of each execution, so that a request which resends an earlier one's
messages plus new ones is decoded from where those messages end (`anthropic_request.decode_conversation`).

Per execution the `per_execution` most recent (an execution's agents interleave their calls; a matching
one is found by comparing bytes, so any entry is safe to try); across executions the kept bodies total at
most `max_bytes` (`ProxyConfig.decoded_bodies_bytes`), the least recently used execution's going first.
A value is whatever the decoder keeps for a body; this module only bounds and finds them.
"""

from __future__ import annotations

from collections import OrderedDict


class BodyCache[T]:
    """Execution id -> its most recent (body size, decoded) entries, newest first; not thread-safe (the
    proxy's state lock)."""

    def __init__(self, max_bytes: int, per_execution: int = 4) -> None:
        self.max_bytes = max_bytes
        self.per_execution = per_execution
        self._entries: OrderedDict[str, list[tuple[int, T]]] = OrderedDict()
        self._bytes = 0

    def get(self, ex: str) -> list[T]:
        kept = self._entries.get(ex)
        if kept is None:
            return []
        self._entries.move_to_end(ex)
        return [v for _, v in kept]

    def put(self, ex: str, size: int, value: T) -> None:
        """Keep `value` (for a body of `size` bytes) as `ex`'s newest; older ones past the bounds go."""
        if size > self.max_bytes:
            return
        kept = self._entries.setdefault(ex, [])
        self._entries.move_to_end(ex)
        kept.insert(0, (size, value))
        self._bytes += size
        while len(kept) > self.per_execution:
            self._bytes -= kept.pop()[0]
        while self._bytes > self.max_bytes:
            oldest = next(iter(self._entries))
            entries = self._entries[oldest]
            self._bytes -= entries.pop()[0]
            if not entries:
                del self._entries[oldest]

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return sum(len(v) for v in self._entries.values())
