"""Reading and writing TITO record streams: JSONL (one tagged object per line, readable) and a framed
msgpack stream (magic header, then length-prefixed frames; token arrays as raw little-endian bytes, so
decoding a 700k-token context is a memcpy, not 700k Python ints). `read_records` also reads other
systems' traces (per-turn rows, verl dumps, slime samples, message logs: `gyre_traj.readers`), telling
the format from a file's first bytes or row.

Readers validate every record and raise `RecordError` naming the file, line or frame, and the call.
A **torn tail** (a writer stopped mid-append: the bytes after the last whole frame cannot hold a frame, or
are all zero; in JSONL a last line with no newline that does not decode) is not an error by default: every
whole record is read and a `TornTailWarning` says where the tail starts and how long it is. Anything
else that does not decode is corrupt, wherever it is (the last whole frame included), and stays an error.
"""

from __future__ import annotations

import io
import json
import os
import struct
import threading
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

import msgspec
import numpy as np

from gyre_traj.readers import iter_foreign, iter_messages, iter_slime, iter_verl
from gyre_traj.records import (
    ID_DTYPE,
    LOGPROB_DTYPE,
    SCHEMA_VERSION,
    Call,
    CallBatch,
    RecordError,
    Role,
    Score,
)

Record = Call | Score | CallBatch
MAGIC = b"GYRETITO\x01"
EXT_IDS = 1
"""The msgpack extension type of an int32 token id array (raw little-endian bytes)."""
EXT_F32 = 2
"""The msgpack extension type of a float32 logprob array (raw little-endian bytes)."""
_EXT_I64 = 3
_EXT_F64 = 4
_I64 = np.dtype("<i8")
_F64 = np.dtype("<f8")
_FRAME = struct.Struct("<I")
Format = Literal["jsonl", "msgpack", "foreign", "verl", "slime", "messages"]
FORMATS: tuple[Format, ...] = ("jsonl", "msgpack", "foreign", "verl", "slime", "messages")
"""gyre's own JSONL and msgpack streams; the per-turn shape; verl's rollout dumps; slime's rollout
samples; logs of OpenAI-compatible / Anthropic calls (`gyre_traj.readers`)."""


def _json_enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"cannot encode {type(obj).__name__}")


def _mp_enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind in "iu":
            if obj.dtype.itemsize > 4:  # batch columns (lengths, versions) keep their 64-bit range
                return msgspec.msgpack.Ext(_EXT_I64, np.ascontiguousarray(obj, _I64).tobytes())
            return msgspec.msgpack.Ext(EXT_IDS, np.ascontiguousarray(obj, ID_DTYPE).tobytes())
        if obj.dtype == np.float64:  # timestamps
            return msgspec.msgpack.Ext(_EXT_F64, np.ascontiguousarray(obj, _F64).tobytes())
        return msgspec.msgpack.Ext(EXT_F32, np.ascontiguousarray(obj, LOGPROB_DTYPE).tobytes())
    raise TypeError(f"cannot encode {type(obj).__name__}")


_EXT_DTYPES: dict[int, np.dtype[Any]] = {
    EXT_IDS: ID_DTYPE,
    EXT_F32: LOGPROB_DTYPE,
    _EXT_I64: _I64,
    _EXT_F64: _F64,
}


def _mp_ext_hook(code: int, data: memoryview) -> Any:
    dtype = _EXT_DTYPES.get(code)
    if dtype is None:
        raise msgspec.ValidationError(f"unknown msgpack extension type {code}")
    try:
        return np.frombuffer(data, dtype)
    except ValueError:  # a length that is not a multiple of the item size
        raise msgspec.ValidationError(
            f"an array of {dtype} (extension type {code}) holds {len(data)} bytes, not a multiple of "
            f"{dtype.itemsize}"
        ) from None


def _dec_hook(tp: type, obj: Any) -> Any:
    if tp is np.ndarray:
        return obj if isinstance(obj, np.ndarray) else np.asarray(obj)
    raise TypeError(f"no decoder for {tp}")  # msgspec reports it as a ValidationError


class Codec:
    """Encoders and decoders for records, built once and reused (one per thread that owns a stream)."""

    def __init__(self) -> None:
        self.json_enc = msgspec.json.Encoder(enc_hook=_json_enc_hook)
        self.json_dec = msgspec.json.Decoder(Record, dec_hook=_dec_hook)
        self.mp_enc = msgspec.msgpack.Encoder(enc_hook=_mp_enc_hook)
        self.mp_dec = msgspec.msgpack.Decoder(Record, dec_hook=_dec_hook, ext_hook=_mp_ext_hook)

    def encode_json(self, rec: Record) -> bytes:
        return self.json_enc.encode(rec)

    def encode_msgpack(self, rec: Record) -> bytes:
        return self.mp_enc.encode(rec)

    def decode_json(self, data: bytes | str) -> Record:
        return self.json_dec.decode(data)

    def decode_msgpack(self, data: bytes | memoryview) -> Record:
        return self.mp_dec.decode(data)


_local = threading.local()


def _mp_decoder() -> msgspec.msgpack.Decoder[Record]:
    """This thread's msgpack record decoder, built once (building one costs more than decoding a
    small frame)."""
    dec: msgspec.msgpack.Decoder[Record] | None = getattr(_local, "mp_dec", None)
    if dec is None:
        dec = _local.mp_dec = msgspec.msgpack.Decoder(Record, dec_hook=_dec_hook, ext_hook=_mp_ext_hook)
    return dec


def decode_msgpack_record(data: bytes | memoryview, name: str = "<frame>") -> Record:
    """One record from its msgpack bytes (a frame's payload without the length prefix: what the proxy
    sends as one ZeroMQ message), with this thread's decoder. Arrays in it are views into `data`. Bytes
    that do not decode, or a record that is not valid, are a `RecordError` naming `name`."""
    try:
        return _mp_decoder().decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError, RecordError) as exc:
        raise _wrap(exc, name) from None


class DeltaView(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """`Delta` as `CallView` reads it: the appended ids left as they came (see `CallView`)."""

    parent: str
    keep: int
    append: Any


class CallView(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
    tag="call",
    tag_field="kind",
    gc=False,
):
    """A `Call` record's msgpack bytes read without building its arrays or validating them: the same
    fields and field types as `Call` (so msgspec accepts and refuses the same messages), but each token
    array is left in the message: an array sent as a msgpack extension value (the proxy's encoding:
    `EXT_IDS` for int32 ids, `EXT_F32` for float32 logprobs) is a `msgspec.msgpack.Ext` whose `data` is a
    memoryview into the message (msgspec builds it, no Python hook runs); anything else is left as
    msgspec met it (a list, for ids sent as a msgpack array). The live ingest path
    (`Forest.ingest_frame`) reads a call straight into its tree through it (`ExecutionTree.add_view`);
    whatever it cannot take that way is decoded in full as a `Call`."""

    execution_id: str
    call_id: str
    agent_id: str
    role: Role
    output_ids: Any
    output_logprobs: Any
    weight_version: int
    finish_reason: str = "stop"
    input_ids: Any = None
    input_delta: DeltaView | None = None
    t_start: float = 0.0
    t_end: float = 0.0
    v: int = SCHEMA_VERSION
    metadata: dict[str, str] = msgspec.field(default_factory=dict)


def call_view_decoder() -> msgspec.msgpack.Decoder[CallView]:
    """A decoder of messages into `CallView`s (one per thread that reads a socket): it raises msgspec's
    errors for a message that is not one (another kind of record, or anything msgspec refuses: the full
    decoder then says what, `decode_msgpack_record`)."""
    return msgspec.msgpack.Decoder(CallView, ext_hook=msgspec.msgpack.Ext)


def _wrap(exc: Exception, where: str) -> RecordError:
    return RecordError(f"{where}: {exc}")


# ---------------------------------------------------------------------------------------------- writing


class RecordWriter:
    """Appends records to a file, JSONL or framed msgpack. `flush()` pushes to the OS; with `fsync=True`
    each `write` also reaches the disk before it returns (the proxy's crash-safe log)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        fmt: Literal["jsonl", "msgpack"] = "jsonl",
        *,
        fsync: bool = False,
        append: bool = True,
    ) -> None:
        self.path = Path(path)
        self.fmt = fmt
        self.fsync = fsync
        self._codec = Codec()
        exists = self.path.exists() and self.path.stat().st_size > 0
        if fmt == "msgpack" and exists and append:
            with self.path.open("rb") as fh:
                if fh.read(len(MAGIC)) != MAGIC:
                    raise RecordError(f"{self.path}: exists and is not a gyre msgpack record stream")
        self._fh: IO[bytes] = self.path.open("ab" if append else "wb")
        if fmt == "msgpack" and not (exists and append):
            self._fh.write(MAGIC)

    def write(self, rec: Record) -> None:
        if self.fmt == "jsonl":
            self._fh.write(self._codec.encode_json(rec) + b"\n")
        else:
            payload = self._codec.encode_msgpack(rec)
            self._fh.write(_FRAME.pack(len(payload)) + payload)
        if self.fsync:
            self._fh.flush()
            os.fsync(self._fh.fileno())

    def write_all(self, recs: Iterable[Record]) -> None:
        for rec in recs:
            self.write(rec)

    def flush(self) -> None:
        self._fh.flush()

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.flush()
            self._fh.close()

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_records(
    path: str | os.PathLike[str],
    recs: Iterable[Record],
    fmt: Literal["jsonl", "msgpack"] | None = None,
    batch: int | None = None,
) -> None:
    """Write a whole stream (overwrites). Format from the suffix (.jsonl / .msgpack) unless given; with
    `batch`, calls are written as `CallBatch`es of up to that many calls per execution."""
    fmt = fmt or ("msgpack" if str(path).endswith((".msgpack", ".mpk")) else "jsonl")
    if batch is not None:
        recs = batch_calls(recs, batch)
    with RecordWriter(path, fmt, append=False) as w:
        w.write_all(recs)


def batch_calls(recs: Iterable[Record], max_calls: int = 1024) -> Iterator[Record]:
    """Group calls into `CallBatch`es of up to `max_calls` calls per execution, keeping each execution's
    order (batches already built and scores pass through; an execution's pending calls are emitted
    before a score or batch of the same execution, and all that is pending at the end)."""
    if max_calls < 1:
        raise ValueError(f"max_calls must be >= 1, got {max_calls}")
    pending: dict[str, list[Call]] = {}
    for rec in recs:
        if isinstance(rec, Call):
            group = pending.setdefault(rec.execution_id, [])
            group.append(rec)
            if len(group) >= max_calls:
                yield CallBatch.of(group)
                del pending[rec.execution_id]
            continue
        group = pending.pop(rec.execution_id, [])
        if group:
            yield CallBatch.of(group)
        yield rec
    for group in pending.values():
        yield CallBatch.of(group)


def encode_msgpack_stream(recs: Iterable[Record], batch: int | None = None) -> bytes:
    """A framed msgpack stream of `recs`; with `batch`, calls are grouped into `CallBatch`es of up to
    that many calls per execution (see `batch_calls`)."""
    if batch is not None:
        recs = batch_calls(recs, batch)
    codec = Codec()
    buf = io.BytesIO()
    buf.write(MAGIC)
    for rec in recs:
        payload = codec.encode_msgpack(rec)
        buf.write(_FRAME.pack(len(payload)))
        buf.write(payload)
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------- reading


class TornTailWarning(UserWarning):
    """A record stream ends in a torn record (a writer stopped mid-append: a crash, a full disk). Every
    whole record before it was read; the torn bytes were left out. `where` is a byte offset (msgpack) or
    a line number (JSONL), `size` the torn bytes, `records` the whole records read."""

    def __init__(self, name: str, where: str, size: int, records: int) -> None:
        super().__init__(
            f"{name}: torn tail of {size} bytes at {where} left out (a writer stopped mid-append); "
            f"{records} whole records read before it"
        )
        self.name = name
        self.where = where
        self.size = size
        self.records = records


def _torn(name: str, where: str, size: int, records: int, tolerate: bool) -> None:
    """Report a torn tail: a warning when tolerated, else a `RecordError`."""
    if not tolerate:
        raise RecordError(
            f"{name}: torn tail of {size} bytes at {where} (a writer stopped mid-append; "
            f"read with tolerate_torn_tail=True to get the {records} whole records before it)"
        )
    warnings.warn(TornTailWarning(name, where, size, records), stacklevel=3)


def iter_jsonl(
    lines: Iterable[bytes | str], name: str = "<stream>", *, tolerate_torn_tail: bool = True
) -> Iterator[Record]:
    """Records of a JSONL stream, one per non-blank line. A last line with no newline that does not
    decode is a torn tail (see the module docstring); any other line that does not decode is an error."""
    codec = Codec()
    n = 0
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = codec.decode_json(line)
        except (msgspec.ValidationError, msgspec.DecodeError, RecordError) as exc:
            raw = line.encode() if isinstance(line, str) else line
            if not raw.endswith(b"\n"):  # only the last line can lack its newline
                size = len(raw)
                _torn(name, f"line {lineno}", size, n, tolerate_torn_tail)
                return
            raise _wrap(exc, f"{name}:{lineno}") from None
        n += 1
        yield rec


@dataclass(frozen=True)
class FrameScan:
    """The structure of a framed msgpack stream, from its frame headers alone (nothing decoded)."""

    frames: int
    """Whole frames (a frame whose declared length fits in the stream)."""
    end: int
    """Byte offset just past the last whole frame (the magic's end when there is none)."""
    torn: int
    """Bytes after `end`: the torn tail (0 when the stream ends on a whole frame)."""


def _tail_is_torn(view: memoryview, pos: int) -> bool:
    """Whether the bytes from `pos` on cannot begin a whole frame: a short header, a declared length
    running past the end, or nothing but zero bytes (no record encodes to an empty frame; some
    filesystems leave a file extended but zero-filled after a crash)."""
    rest = len(view) - pos
    if rest < _FRAME.size:
        return True
    (size,) = _FRAME.unpack_from(view, pos)
    if size > rest - _FRAME.size:
        return True
    return size == 0 and not np.frombuffer(view[pos:], np.uint8).any()


def _check_magic(view: memoryview, name: str) -> bool:
    """True when the stream holds the whole magic; False when it is a torn prefix of it (a writer
    stopped while starting the stream); anything else is a `RecordError`."""
    head = bytes(view[: len(MAGIC)])
    if head == MAGIC:
        return True
    if len(view) < len(MAGIC) and MAGIC.startswith(head):
        return False
    raise RecordError(f"{name}: not a gyre msgpack record stream (bad magic)")


def scan_msgpack(data: bytes | memoryview | Any, name: str = "<stream>") -> FrameScan:
    """Where the whole frames of a framed msgpack stream end and how long its torn tail is, reading
    only frame headers (a writer uses it to cut a torn tail off before appending). An `mmap` of the file
    works: only the pages holding headers are read."""
    with memoryview(data) as view:  # released on the way out, so an mmap can close after an error
        if not _check_magic(view, name):
            return FrameScan(0, 0, len(view))
        pos, n, frames = len(MAGIC), len(view), 0
        while pos < n:
            if _tail_is_torn(view, pos):
                return FrameScan(frames, pos, n - pos)
            (size,) = _FRAME.unpack_from(view, pos)
            pos += _FRAME.size + size
            frames += 1
        return FrameScan(frames, pos, 0)


def iter_msgpack(
    data: bytes | memoryview, name: str = "<stream>", *, tolerate_torn_tail: bool = True
) -> Iterator[Record]:
    """Decode a framed msgpack stream held in memory. Arrays in the records are views into `data`. A
    torn tail is reported (module docstring); a whole frame that does not decode is a `RecordError`."""
    view = memoryview(data)
    if not _check_magic(view, name):
        _torn(name, "byte 0", len(view), 0, tolerate_torn_tail)
        return
    decode = _mp_decoder().decode
    pos, n, frame = len(MAGIC), len(view), 0
    while pos < n:
        if _tail_is_torn(view, pos):
            _torn(name, f"byte {pos} (after frame {frame - 1})", n - pos, frame, tolerate_torn_tail)
            return
        (size,) = _FRAME.unpack_from(view, pos)
        pos += _FRAME.size
        try:
            rec = decode(view[pos : pos + size])
        except (msgspec.ValidationError, msgspec.DecodeError, RecordError) as exc:
            raise _wrap(exc, f"{name}: frame {frame} (byte {pos - _FRAME.size})") from None
        yield rec
        pos += size
        frame += 1


def _first_row_keys(path: Path) -> set[str] | None:
    """The keys of the first non-blank line's JSON object; None for an empty file or a line that is not
    one (a torn line, say: the reader then says what is wrong, naming the line)."""
    with path.open("rb") as fh:
        for line in fh:
            if line.strip():
                break
        else:
            return None
    try:
        return set(_KEYS.decode(line))
    except (msgspec.DecodeError, msgspec.ValidationError):
        try:
            obj = json.loads(line)  # Python's writers put NaN / Infinity in rows: keys are still keys
        except (ValueError, RecursionError):
            return None
        return set(obj) if isinstance(obj, dict) else None


_KEYS = msgspec.json.Decoder(dict[str, msgspec.Raw])
_VERL_DUMP = {"input", "output", "score", "step"}


def _layout(keys: set[str]) -> Format | None:
    """The format a JSONL file's first row says it is in, from its keys."""
    if "kind" in keys:
        return "jsonl"
    if {"request", "response"} <= keys or "choices" in keys or {"type", "role", "content"} <= keys:
        return "messages"
    if {"tokens", "response_length"} <= keys:
        return "slime"
    if "response_ids" in keys or keys >= _VERL_DUMP:
        return "verl"
    if "prompt_ids" in keys or "output_ids" in keys:
        return "foreign"
    return None


def dump_files(path: Path) -> list[Path]:
    """The JSONL files of a dump directory in step order (verl names them `<step>.jsonl`; other names
    come after, by name)."""
    files = [p for p in path.iterdir() if p.suffix == ".jsonl" and p.is_file()]
    return sorted(files, key=lambda p: (0, int(p.stem), "") if p.stem.isdigit() else (1, 0, p.name))


def sniff_format(path: str | os.PathLike[str]) -> Format:
    """A file's format: gyre's msgpack stream (its magic), else a JSONL layout told by the keys of its
    first row (a directory: by its first dump file). A row whose keys match no layout is an error that
    lists them."""
    path = Path(path)
    if path.is_dir():
        files = dump_files(path)
        if not files:
            raise RecordError(f"{path}: a directory with no .jsonl file")
        return sniff_format(files[0])
    with path.open("rb") as fh:
        head = fh.read(len(MAGIC))
    if head.startswith(MAGIC) or (head and MAGIC.startswith(head)):  # the latter: torn in its magic
        return "msgpack"
    keys = _first_row_keys(path)
    if keys is None:
        return "jsonl"
    fmt = _layout(keys)
    if fmt is None:
        raise RecordError(
            f"{path}: cannot tell the format from the first row's keys ({', '.join(sorted(keys)[:12])}): "
            "gyre records have `kind`; message logs `choices` or `request`+`response`; slime samples "
            "`tokens`+`response_length`; verl dump rows `input`, `output`, `score`, `step` (token ids "
            "in `prompt_ids`/`response_ids`); per-turn rows `prompt_ids`/`output_ids`. Name it with "
            f"fmt= (one of {', '.join(FORMATS)})"
        )
    return fmt


def read_records(
    path: str | os.PathLike[str],
    fmt: Format | None = None,
    *,
    tolerate_torn_tail: bool = True,
    reward_key: str | None = None,
) -> Iterator[Record]:
    """All records of a file (or of a dump directory's `.jsonl` files, in step order), in order. The
    format is sniffed unless given (`FORMATS`). A torn tail of gyre's own streams (a writer stopped
    mid-append) is left out with a `TornTailWarning` unless `tolerate_torn_tail=False`. `reward_key`
    names the entry to train on where rewards are dicts (slime's `--reward-key`)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such record file: {path}")
    fmt = fmt or sniff_format(path)
    if fmt not in FORMATS:
        raise ValueError(f"unknown record format {fmt!r}; one of {', '.join(FORMATS)}")
    if path.is_dir():
        for file in dump_files(path):
            yield from read_records(file, fmt, tolerate_torn_tail=tolerate_torn_tail, reward_key=reward_key)
        return
    if fmt == "msgpack":
        yield from iter_msgpack(path.read_bytes(), str(path), tolerate_torn_tail=tolerate_torn_tail)
        return
    with path.open("rb") as fh:
        if fmt == "jsonl":
            yield from iter_jsonl(fh, str(path), tolerate_torn_tail=tolerate_torn_tail)
        elif fmt == "foreign":
            yield from iter_foreign(fh, str(path))
        elif fmt == "verl":
            yield from iter_verl(fh, str(path))
        elif fmt == "slime":
            yield from iter_slime(fh, str(path), reward_key=reward_key)
        else:
            yield from iter_messages(fh, str(path), default_execution=path.stem, reward_key=reward_key)
