"""Arrays on the wire and micro-batch checks: a header of `ArraySpec`s plus one raw frame per array.

`to_frames`/`from_frames` move numpy arrays without copies on the send side and with one `np.frombuffer`
view on the receive side; a frame whose size disagrees with its spec is an error, never a silent reshape.
Only plain little-endian numbers cross the wire (`WIRE_DTYPES`): any other dtype string in a spec is a
`MicroBatchError`, as is a frame whose size disagrees with its spec, so a malformed header from a peer is
refused rather than raised from deep inside numpy. `check_microbatch` is what the core runs on every micro-batch before it enters the claim queue: a batch
that does not fit the token budget, names tokens outside the vocabulary or carries a malformed ancestor
mask is refused with a `MicroBatchError` that says what is wrong.
"""

from __future__ import annotations

import math
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


WIRE_DTYPES = frozenset({"|b1", "|i1", "|u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8", "<f2", "<f4", "<f8"})
"""The dtype strings an `ArraySpec` may name (numpy's `dtype.str`): booleans, integers and floats,
little-endian. Anything else (objects, strings, records, big-endian, unknown names) is refused."""

INTEGER_FIELDS = frozenset(MICROBATCH_FIELDS) - {"old_logprobs", "advantages", "weights"}


class MicroBatchError(ValueError):
    """A micro-batch that cannot be trained: too large, out-of-vocabulary ids, a malformed mask, or
    arrays whose frames do not match their specs."""


def to_frames(arrays: Mapping[str, np.ndarray]) -> tuple[tuple[ArraySpec, ...], list[Any]]:
    specs = []
    frames: list[Any] = []
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        specs.append(ArraySpec(name, a.dtype.str, tuple(int(x) for x in a.shape)))
        frames.append(memoryview(a).cast("B") if a.size else b"")
    return tuple(specs), frames


def from_frames(specs: Sequence[ArraySpec], frames: Sequence[Any]) -> dict[str, np.ndarray]:
    """Views of `frames` as the arrays `specs` describe; MicroBatchError for a spec that names a dtype
    outside `WIRE_DTYPES`, a negative dimension, a repeated name, or a frame of the wrong size."""
    if len(specs) != len(frames):
        raise MicroBatchError(f"{len(specs)} array specs but {len(frames)} frames")
    out = {}
    for s, f in zip(specs, frames, strict=True):
        if s.dtype not in WIRE_DTYPES:
            raise MicroBatchError(f"array {s.name!r}: dtype {s.dtype!r} is not one of {sorted(WIRE_DTYPES)}")
        if any(d < 0 for d in s.shape):
            raise MicroBatchError(f"array {s.name!r}: negative dimension in shape {s.shape}")
        if s.name in out:
            raise MicroBatchError(f"array {s.name!r} appears twice")
        dt = np.dtype(s.dtype)
        buf = f.buffer if hasattr(f, "buffer") else f
        n = math.prod(s.shape) * dt.itemsize  # Python ints: no overflow for absurd shapes
        if memoryview(buf).nbytes != n:
            raise MicroBatchError(
                f"array {s.name!r}: frame has {memoryview(buf).nbytes} bytes, spec needs {n}"
            )
        out[s.name] = np.frombuffer(buf, dtype=dt).reshape(s.shape) if n else np.zeros(s.shape, dt)
    return out


def microbatch_arrays(b: PackedBatch) -> dict[str, np.ndarray]:
    return {k: getattr(b, k) for k in MICROBATCH_FIELDS}


def microbatch_from_arrays(arrays: Mapping[str, np.ndarray]) -> PackedBatch:
    missing = [k for k in MICROBATCH_FIELDS if k not in arrays]
    if missing:
        raise MicroBatchError(f"micro-batch is missing arrays {missing}")
    for k in MICROBATCH_FIELDS:
        kind = arrays[k].dtype.kind
        if kind not in ("iu" if k in INTEGER_FIELDS else "f") or arrays[k].ndim != 1:
            raise MicroBatchError(
                f"micro-batch array {k!r} is {arrays[k].dtype} of shape {arrays[k].shape}: expected a "
                f"one-dimensional {'integer' if k in INTEGER_FIELDS else 'float'} array"
            )
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
