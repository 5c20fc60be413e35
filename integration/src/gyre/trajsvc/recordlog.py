"""The proxy's record log as a run reads it after a crash: whole frames, and a torn tail set aside.

gyre-proxy appends each record as one length-prefixed msgpack frame (gyre-traj's framed stream) and
fsyncs before the call's response completes, so a crash can leave at most one frame cut short at the end
(a call whose client never got an answer). `scan` walks the frame headers and says where the whole
frames end; `set_aside_torn_tail` moves the bytes past that point into `<log>.torn-<offset>` (nothing
is deleted) and cuts the log back, so a proxy that reopens the log appends after a whole frame;
`calls` reads every whole record. A frame that is whole but does not decode is gyre-traj's
`RecordError`, never skipped.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gyre_traj.io import MAGIC, Codec
from gyre_traj.records import Call

_FRAME = struct.Struct("<I")


@dataclass(frozen=True)
class Scan:
    frames: int
    whole_bytes: int
    """Bytes up to the end of the last whole frame (the magic included)."""
    size: int

    @property
    def torn(self) -> bool:
        return self.size > self.whole_bytes


def scan(path: Path) -> Scan:
    """Count the whole frames of the log (reads the frame headers only)."""
    size = path.stat().st_size
    with path.open("rb") as fh:
        if size < len(MAGIC):  # a log cut before its magic was written holds nothing
            return Scan(0, 0, size)
        if fh.read(len(MAGIC)) != MAGIC:
            raise ValueError(f"{path}: not a gyre msgpack record stream (bad magic)")
        pos, frames = len(MAGIC), 0
        while pos + _FRAME.size <= size:
            fh.seek(pos)
            (n,) = _FRAME.unpack(fh.read(_FRAME.size))
            if pos + _FRAME.size + n > size:
                break
            pos += _FRAME.size + n
            frames += 1
    return Scan(frames, pos, size)


def set_aside_torn_tail(path: Path) -> Path | None:
    """Move a torn last frame into `<log>.torn-<offset>` and cut the log back to its whole frames;
    returns where the bytes went (None: the log was whole or absent)."""
    if not path.exists():
        return None
    s = scan(path)
    if not s.torn:
        return None
    aside = path.with_name(f"{path.name}.torn-{s.whole_bytes}")
    with path.open("r+b") as fh:
        fh.seek(s.whole_bytes)
        aside.write_bytes(fh.read())
        fh.truncate(s.whole_bytes)
    return aside


def calls(path: Path, start: int = 0) -> Iterator[tuple[int, Call]]:
    """Every whole `Call` of the log from byte `start` (0: the beginning), with the offset after it."""
    if not path.exists():
        return
    codec = Codec()
    s = scan(path)
    with path.open("rb") as fh:
        pos = max(start, len(MAGIC))
        while pos < s.whole_bytes:
            fh.seek(pos)
            (n,) = _FRAME.unpack(fh.read(_FRAME.size))
            rec = codec.decode_msgpack(fh.read(n))
            pos += _FRAME.size + n
            if isinstance(rec, Call):
                yield pos, rec
