"""The micro-batches of each applied step, kept on disk so the same training can be timed again alone
(`CoreConfig.keep_batches`): what a benchmark compares a run's training with.

One file per step, `step-<seq>.gtb`: a magic line, then a little-endian u32 length and a msgpack header
(`StepFile`: the step's queue position, its execution count and, per micro-batch, the `ArraySpec`s of
its arrays), then every array's raw bytes in header order. Reading checks the header strictly and each
frame against its spec (`wire.from_frames`), so a truncated or foreign file is a `MicroBatchError`,
never a silent reshape; nothing is unpickled.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from pathlib import Path

import msgspec
from gyre_traj.pack import PackedBatch

from gyre_train.protocol import ArraySpec
from gyre_train.wire import MicroBatchError, from_frames, microbatch_arrays, microbatch_from_arrays, to_frames

MAGIC = b"gyre-microbatches/1\n"
_LEN = struct.Struct("<I")


class StepFile(msgspec.Struct, frozen=True, array_like=True):
    seq: int
    executions: int
    microbatches: list[tuple[ArraySpec, ...]]


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(StepFile)


def write_step(directory: Path, seq: int, microbatches: Sequence[PackedBatch], executions: int) -> Path:
    """Write step `seq`'s micro-batches (atomically: a temporary file renamed into place)."""
    directory.mkdir(parents=True, exist_ok=True)
    specs, frames = [], []
    for b in microbatches:
        s, f = to_frames(microbatch_arrays(b))
        specs.append(s)
        frames.extend(f)
    header = _enc.encode(StepFile(seq, executions, specs))
    path = directory / f"step-{seq:06d}.gtb"
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as fh:
        fh.write(MAGIC + _LEN.pack(len(header)) + header)
        for f in frames:
            fh.write(f)
    tmp.rename(path)
    return path


def read_step(path: Path) -> tuple[StepFile, list[PackedBatch]]:
    """One step file: its header and its micro-batches (MicroBatchError if it is not one). The arrays are
    views of one writable buffer, so torch takes them without a read-only warning."""
    data = bytearray(path.read_bytes())
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + _LEN.size:
        raise MicroBatchError(f"{path}: not a gyre micro-batch file")
    at = len(MAGIC)
    (n,) = _LEN.unpack_from(data, at)
    at += _LEN.size
    try:
        head = _dec.decode(data[at : at + n])
    except msgspec.MsgspecError as exc:
        raise MicroBatchError(f"{path}: bad header: {exc}") from None
    at += n
    out = []
    view = memoryview(data)
    for specs in head.microbatches:
        frames = []
        for s in specs:
            size = _nbytes(s)
            if at + size > len(data):
                raise MicroBatchError(f"{path}: truncated in array {s.name}")
            frames.append(view[at : at + size])
            at += size
        out.append(microbatch_from_arrays(from_frames(specs, frames)))
    if at != len(data):
        raise MicroBatchError(f"{path}: {len(data) - at} bytes after the last array")
    return head, out


def read_steps(directory: Path) -> list[tuple[StepFile, list[PackedBatch]]]:
    """Every step file in `directory`, in queue order."""
    return [read_step(p) for p in sorted(directory.glob("step-*.gtb"))]


def _nbytes(s: ArraySpec) -> int:
    import numpy as np

    try:
        item = np.dtype(s.dtype).itemsize
    except TypeError as exc:
        raise MicroBatchError(f"array {s.name}: unknown dtype {s.dtype!r}") from exc
    n = 1
    for d in s.shape:
        if d < 0:
            raise MicroBatchError(f"array {s.name}: negative dimension in {s.shape}")
        n *= d
    return n * item
