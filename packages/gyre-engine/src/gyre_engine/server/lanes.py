"""Decode lanes: running requests grouped into left-padded batches of similar length.

With a slot batch (`slots.py`, CUDA), rows go to its fixed slots first while they fit; the lanes take
the rest (rows too long for a slot, or more rows than slots). The long slots (`long_kv.py`: rows
prefilled in place, each in a slot of its own) are one more slot batch and lane, decoded in one step
for all their rows, kept while empty so the buffer and graphs stay. One batch for all rows would pad
every short row to the longest context (an agent at 30k tokens next to one at 2k would cost 30k of KV
per row). A row joins a lane only while the lane's longest row stays within
twice its shortest plus `slack` tokens; otherwise it opens a new lane. Each engine step decodes every lane.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from gyre_engine.server.batch import DecodeBatch, LongRowKV, RowKV, SlotRowKV
from gyre_engine.server.request import Running
from gyre_engine.server.slots import SlotBatch


@dataclass
class Lane:
    """A decode batch and its requests; `reqs[i]` is row i of `batch`."""

    batch: DecodeBatch | SlotBatch
    reqs: list[Running] = field(default_factory=list)

    def drop(self, rows: list[int]) -> None:
        order = self.batch.remove(rows)
        if order is None:
            gone = set(rows)
            order = [i for i in range(len(self.reqs)) if i not in gone]
        self.reqs = [self.reqs[i] for i in order]


class Lanes:
    """All running requests, in lanes of bounded padding."""

    def __init__(self, device: torch.device, slack: int = 64, slots: SlotBatch | None = None) -> None:
        self.device = device
        self.slack = slack
        self.eager: list[Lane] = []
        self.slot_lane = Lane(slots) if slots is not None else None
        self.long: Lane | None = None
        """The long slots' lane (its batch made on first use), with or without rows."""

    @property
    def lanes(self) -> list[Lane]:
        """Every lane with rows: the slot lane first, then the long slots', then the eager ones."""
        s, x = self.slot_lane, self.long
        return (
            ([s] if s is not None and s.reqs else []) + ([x] if x is not None and x.reqs else []) + self.eager
        )

    def __len__(self) -> int:
        return sum(len(lane.reqs) for lane in self.lanes)

    def requests(self) -> list[Running]:
        return [r for lane in self.lanes for r in lane.reqs]

    def _fits(self, lo: int, hi: int, n: int) -> bool:
        return max(hi, n) <= 2 * min(lo, n) + self.slack

    def place(self, items: list[tuple[Running, RowKV, int]]) -> None:
        """Add prefilled requests (request, its KV, its next input token); one re-pad per lane touched. A
        row prefilled in a long slot (`LongRowKV`) or in a decode slot (`SlotRowKV`, placed before the rows
        copied in) starts in that slot."""
        for r, kv, tok in items:
            if isinstance(kv, LongRowKV):
                lane = self.long
                assert lane is not None and isinstance(lane.batch, SlotBatch) and lane.batch.kv is kv.buf
                lane.batch.start_row(kv.row, kv.length, tok)
                lane.reqs.append(r)
        in_slots = [(kv.slot, r, kv, tok) for r, kv, tok in items if isinstance(kv, SlotRowKV)]
        if in_slots:
            lane = self.slot_lane
            assert lane is not None and isinstance(lane.batch, SlotBatch)
            for _, r, kv, tok in sorted(in_slots, key=lambda x: x[0]):
                lane.batch.start_row(kv.slot, kv.length, tok)
                lane.reqs.append(r)
        items = [x for x in items if not isinstance(x[1], LongRowKV | SlotRowKV)]
        if self.slot_lane is not None:
            slots = self.slot_lane.batch
            assert isinstance(slots, SlotBatch)
            room = slots.free()
            to_slots = []
            rest = []
            for item in items:
                if room > 0 and slots.fits(item[1].length):
                    to_slots.append(item)
                    room -= 1
                else:
                    rest.append(item)
            if to_slots:
                slots.add_many([(kv, tok) for _, kv, tok in to_slots])
                self.slot_lane.reqs.extend(r for r, _, _ in to_slots)
            items = rest
        bounds = [(min(lane.batch.lengths), max(lane.batch.lengths)) for lane in self.eager]
        pending: list[list[tuple[Running, RowKV, int]]] = [[] for _ in self.eager]
        for item in items:
            n = item[1].length
            for i, (lo, hi) in enumerate(bounds):
                if self._fits(lo, hi, n):
                    bounds[i] = (min(lo, n), max(hi, n))
                    pending[i].append(item)
                    break
            else:
                self.eager.append(Lane(DecodeBatch(self.device)))
                bounds.append((n, n))
                pending.append([item])
        for lane, new in zip(self.eager, pending, strict=True):
            if new:
                lane.batch.add_many([(kv, tok) for _, kv, tok in new])
                lane.reqs.extend(r for r, _, _ in new)

    def find(self, rid: str) -> tuple[Lane, int] | None:
        return self.find_where(lambda r: r.rid == rid)

    def find_where(self, match: Callable[[Running], bool]) -> tuple[Lane, int] | None:
        """The lane and row of the first running request `match` accepts."""
        for lane in self.lanes:
            for i, r in enumerate(lane.reqs):
                if match(r):
                    return lane, i
        return None

    def evict_full_slots(self) -> None:
        """Move rows whose next token would overflow their slot to the eager lanes (KV copied out)."""
        lane = self.slot_lane
        if lane is None or not lane.reqs:
            return
        slots = lane.batch
        assert isinstance(slots, SlotBatch)
        full = slots.full_rows()
        if not full:
            return
        moving = [(lane.reqs[i], slots.row_kv(i).clone(), slots.next_tokens[i]) for i in full]
        lane.drop(full)
        slot_lane, self.slot_lane = self.slot_lane, None
        try:
            self.place(moving)
        finally:
            self.slot_lane = slot_lane

    def prune(self) -> None:
        self.eager = [lane for lane in self.eager if lane.reqs]

    def clear(self) -> list[Running]:
        """Drop every row (and its KV); returns the requests in row order."""
        out = self.requests()
        self.eager = []
        if self.long is not None:
            assert isinstance(self.long.batch, SlotBatch)
            self.long.batch.clear()
            self.long.reqs = []
        if self.slot_lane is not None:
            self.slot_lane.batch.clear()  # type: ignore[union-attr]
            self.slot_lane.reqs = []
        return out
