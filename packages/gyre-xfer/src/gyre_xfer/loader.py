"""What an engine calls: `WeightLoader` takes a published snapshot into its model's parameters, whole
or not at all; the KV side is `KvPool` (kv.py) plus the `KvOffer`/`KvReceipt` records in protocol.py.

By default a version is pulled into the subscriber's staging buffer, converted, checked against every
parameter's name, shape and dtype, and only then copied in, so a failed pull leaves the model as it was.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .buffers import DTYPES, view_of
from .errors import ShapeMismatchError
from .subscriber import Converter, Subscriber, SubscriberConfig
from .transport import Transport


@dataclass(frozen=True, slots=True)
class LoadResult:
    version: int
    nbytes: int
    pull_s: float
    copy_s: float


class WeightLoader:
    """Loads snapshots from one publisher into `params` (name -> numpy array or torch tensor)."""

    def __init__(
        self,
        transport: Transport,
        config: SubscriberConfig,
        params: Mapping[str, Any],
        convert: Converter | None = None,
        dtypes: Mapping[str, str] | None = None,
    ) -> None:
        self.subscriber = Subscriber(transport, config)
        self.params = dict(params)
        self.convert = convert
        self.dtypes = dict(dtypes or {})
        self.version = 0

    def load(self, min_version: int = 0, direct: bool = False) -> LoadResult:
        """Pull the newest version >= `min_version` into the parameters. `direct=True` (no converter)
        pulls straight into them, saving a copy; then a failure leaves them mixed: re-load before use."""
        if direct:
            if self.convert is not None:
                raise ValueError("direct loads cannot convert layouts; pass direct=False")
            snap = self.subscriber.pull(min_version, into=self.params, dtypes=self.dtypes)
            self.version = snap.version
            return LoadResult(snap.version, snap.nbytes, snap.elapsed_s, 0.0)
        snap = self.subscriber.pull(min_version)
        arrays: Mapping[str, np.ndarray] = snap.arrays
        if self.convert is not None:
            arrays = self.convert(arrays)
        self._check(arrays)
        t0 = time.monotonic()
        for name, arr in arrays.items():
            _copy(self.params[name], arr)
        self.version = snap.version
        return LoadResult(snap.version, snap.nbytes, snap.elapsed_s, time.monotonic() - t0)

    def _check(self, arrays: Mapping[str, np.ndarray]) -> None:
        missing = sorted(self.params.keys() - arrays.keys())
        extra = sorted(arrays.keys() - self.params.keys())
        if missing or extra:
            raise ShapeMismatchError(
                f"snapshot does not match the model: missing {missing[:8]}, unexpected {extra[:8]}"
            )
        for name, arr in arrays.items():
            want = view_of(self.params[name], self.dtypes.get(name))
            # numpy holds bfloat16 as uint16 words: compare the numpy dtype that carries each name's bytes
            if tuple(arr.shape) != want.shape or arr.dtype != DTYPES[want.dtype][1]:
                raise ShapeMismatchError(
                    f"{name!r}: snapshot has {arr.dtype}{list(arr.shape)}, model has {want.dtype}{list(want.shape)}"
                )

    def close(self) -> None:
        self.subscriber.close()


def _copy(dst: Any, src: np.ndarray) -> None:
    if isinstance(dst, np.ndarray):
        np.copyto(dst.reshape(-1).view(np.uint8), np.ascontiguousarray(src).reshape(-1).view(np.uint8))
        return
    import torch

    raw = torch.from_numpy(np.ascontiguousarray(src).reshape(-1).view(np.uint8))
    with torch.no_grad():
        dst.view(-1).view(torch.uint8).copy_(raw, non_blocking=False)
