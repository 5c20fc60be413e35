"""Decode lanes: running requests grouped into left-padded batches of similar length.

One batch for all rows would pad every short row to the longest context (an agent at 30k tokens next to
one at 2k would cost 30k of KV per row). A row joins a lane only while the lane's longest row stays within
twice its shortest plus `slack` tokens; otherwise it opens a new lane. Each engine step decodes every lane.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gyre_engine.server.batch import DecodeBatch, RowKV
from gyre_engine.server.request import Running


@dataclass
class Lane:
    """A decode batch and its requests; `reqs[i]` is row i of `batch`."""

    batch: DecodeBatch
    reqs: list[Running] = field(default_factory=list)

    def drop(self, rows: list[int]) -> None:
        self.batch.remove(rows)
        gone = set(rows)
        self.reqs = [r for i, r in enumerate(self.reqs) if i not in gone]


class Lanes:
    """All running requests, in lanes of bounded padding."""

    def __init__(self, device: torch.device, slack: int = 64) -> None:
        self.device = device
        self.slack = slack
        self.lanes: list[Lane] = []

    def __len__(self) -> int:
        return sum(len(lane.reqs) for lane in self.lanes)

    def requests(self) -> list[Running]:
        return [r for lane in self.lanes for r in lane.reqs]

    def _fits(self, lo: int, hi: int, n: int) -> bool:
        return max(hi, n) <= 2 * min(lo, n) + self.slack

    def place(self, items: list[tuple[Running, RowKV, int]]) -> None:
        """Add prefilled requests (request, its KV, its next input token); one re-pad per lane touched."""
        bounds = [(min(lane.batch.lengths), max(lane.batch.lengths)) for lane in self.lanes]
        pending: list[list[tuple[Running, RowKV, int]]] = [[] for _ in self.lanes]
        for item in items:
            n = item[1].length
            for i, (lo, hi) in enumerate(bounds):
                if self._fits(lo, hi, n):
                    bounds[i] = (min(lo, n), max(hi, n))
                    pending[i].append(item)
                    break
            else:
                self.lanes.append(Lane(DecodeBatch(self.device)))
                bounds.append((n, n))
                pending.append([item])
        for lane, new in zip(self.lanes, pending, strict=True):
            if new:
                lane.batch.add_many([(kv, tok) for _, kv, tok in new])
                lane.reqs.extend(r for r, _, _ in new)

    def find(self, rid: str) -> tuple[Lane, int] | None:
        for lane in self.lanes:
            for i, r in enumerate(lane.reqs):
                if r.rid == rid:
                    return lane, i
        return None

    def prune(self) -> None:
        self.lanes = [lane for lane in self.lanes if lane.reqs]

    def clear(self) -> list[Running]:
        """Drop every row (and its KV); returns the requests in row order."""
        out = self.requests()
        self.lanes = []
        return out
