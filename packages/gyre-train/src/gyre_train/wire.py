"""Arrays on the wire and micro-batch checks: a header of `ArraySpec`s plus one raw frame per array.

`to_frames`/`from_frames` move numpy arrays without copies on the send side and with one `np.frombuffer`
view on the receive side; a frame whose size disagrees with its spec is an error, never a silent reshape.
`check_microbatch` is what the core runs on every micro-batch before it enters the claim queue: a batch
that does not fit the token budget, names tokens outside the vocabulary or carries a malformed ancestor
mask is refused with a `MicroBatchError` that says what is wrong.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from gyre_traj.pack import PackedBatch, PackError

from gyre_train.protocol import ArraySpec

MICROBATCH_FIELDS = (
    "input_ids",
    "position_ids",
    "parent",
    "last_desc",
    "segment",
    "target_pos",
    "target_ids",
    "old_logprobs",
    "advantages",
    "weights",
    "versions",
    "target_nodes",
)


class MicroBatchError(ValueError):
    """A micro-batch that cannot be trained: too large, out-of-vocabulary ids or a malformed mask."""


def to_frames(arrays: Mapping[str, np.ndarray]) -> tuple[tuple[ArraySpec, ...], list[Any]]:
    specs = []
    frames: list[Any] = []
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        specs.append(ArraySpec(name, a.dtype.str, tuple(int(x) for x in a.shape)))
        frames.append(memoryview(a).cast("B") if a.size else b"")
    return tuple(specs), frames


def from_frames(specs: Sequence[ArraySpec], frames: Sequence[Any]) -> dict[str, np.ndarray]:
    if len(specs) != len(frames):
        raise ValueError(f"{len(specs)} array specs but {len(frames)} frames")
    out = {}
    for s, f in zip(specs, frames, strict=True):
        dt = np.dtype(s.dtype)
        buf = f.buffer if hasattr(f, "buffer") else f
        n = int(np.prod(s.shape, dtype=np.int64)) * dt.itemsize
        if memoryview(buf).nbytes != n:
            raise ValueError(f"array {s.name!r}: frame has {memoryview(buf).nbytes} bytes, spec needs {n}")
        out[s.name] = np.frombuffer(buf, dtype=dt).reshape(s.shape) if n else np.zeros(s.shape, dt)
    return out


def microbatch_arrays(b: PackedBatch) -> dict[str, np.ndarray]:
    return {k: getattr(b, k) for k in MICROBATCH_FIELDS}


def microbatch_from_arrays(arrays: Mapping[str, np.ndarray]) -> PackedBatch:
    missing = [k for k in MICROBATCH_FIELDS if k not in arrays]
    if missing:
        raise MicroBatchError(f"micro-batch is missing arrays {missing}")
    a = arrays
    return PackedBatch(
        mode="tree",
        input_ids=a["input_ids"],
        position_ids=a["position_ids"],
        parent=a["parent"],
        last_desc=a["last_desc"],
        segment=a["segment"],
        target_pos=a["target_pos"],
        target_ids=a["target_ids"],
        old_logprobs=a["old_logprobs"],
        advantages=a["advantages"],
        weights=a["weights"],
        versions=a["versions"],
        target_nodes=a["target_nodes"],
    )


def check_microbatch(b: PackedBatch, *, token_budget: int, vocab_size: int, where: str = "") -> None:
    """Raise MicroBatchError naming the first fault; return quietly for a trainable batch."""
    at = f"micro-batch {where}: " if where else "micro-batch: "
    if b.num_tokens == 0:
        raise MicroBatchError(at + "has no tokens")
    if b.num_tokens > token_budget:
        raise MicroBatchError(
            at + f"has {b.num_tokens} tokens, over the micro-batch budget of {token_budget}; "
            "pack with a smaller token_budget"
        )
    try:
        b.validate()
    except PackError as exc:
        raise MicroBatchError(at + f"malformed: {exc}") from exc
    for name in ("input_ids", "target_ids"):
        a = getattr(b, name)
        if a.size and (int(a.min()) < 0 or int(a.max()) >= vocab_size):
            raise MicroBatchError(at + f"{name} outside the vocabulary [0, {vocab_size})")
    t = b.num_tokens
    idx = np.arange(t)
    par = b.parent.astype(np.int64)
    has = par >= 0
    p = par[has]
    # A child lies inside its parent's subtree interval, and its own subtree nests inside the parent's.
    if np.any(idx[has] > b.last_desc[p]) or np.any(b.last_desc[has] > b.last_desc[p]):
        raise MicroBatchError(
            at + "malformed mask: a token's subtree (last_desc) is not nested in its parent's"
        )
    if np.any(b.position_ids[~has] != 0):
        raise MicroBatchError(at + "malformed: a root token (parent -1) must have position 0")
    if b.num_loss_tokens:
        if np.any(~np.isfinite(b.old_logprobs)) or np.any(b.old_logprobs > 0):
            raise MicroBatchError(at + "old_logprobs must be finite and <= 0")
        if np.any(~np.isfinite(b.weights)) or np.any(b.weights < 0):
            raise MicroBatchError(at + "loss weights must be finite and >= 0")
        if np.any(~np.isfinite(b.advantages)):
            raise MicroBatchError(at + "advantages must be finite")
