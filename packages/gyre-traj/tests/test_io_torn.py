"""Torn tails versus corruption in the readers: a writer that stopped mid-append leaves a torn last
record, which is left out with a `TornTailWarning` (every whole record is read); a whole record that does
not decode is corrupt wherever it is and stays a `RecordError`."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import msgspec
import pytest
from gyre_traj.io import (
    MAGIC,
    Codec,
    TornTailWarning,
    encode_msgpack_stream,
    iter_jsonl,
    iter_msgpack,
    read_records,
    scan_msgpack,
    write_records,
)
from gyre_traj.records import Call, RecordError

from .helpers import OUT, SYS, USER, call, ids

RECS = [
    call("c0", ids(SYS, 1, 2) + ids(USER, 1), ids(OUT, 1, 2)),
    call("c1", None, ids(OUT, 3), delta=("c0", 5, ids(USER, 2))),
    call("c2", ids(SYS, 1) + ids(USER, 9), ids(OUT, 7, 8, 9)),
]


def _frame_starts(data: bytes) -> list[int]:
    starts, pos = [], len(MAGIC)
    while pos < len(data):
        starts.append(pos)
        pos += 4 + struct.unpack_from("<I", data, pos)[0]
    return starts


def _ids(recs: list[object]) -> list[str]:
    return [r.call_id for r in recs if isinstance(r, Call)]


def test_every_cut_inside_the_last_frame_is_a_torn_tail() -> None:
    data = encode_msgpack_stream(RECS)
    last = _frame_starts(data)[-1]
    for cut in range(last + 1, len(data)):
        torn = data[:cut]
        with pytest.warns(TornTailWarning) as w:
            got = list(iter_msgpack(torn, "log"))
        assert _ids(got) == ["c0", "c1"]
        warning = w[0].message
        assert isinstance(warning, TornTailWarning)
        assert (warning.size, warning.records, warning.where) == (
            cut - last,
            2,
            f"byte {last} (after frame 1)",
        )
        assert scan_msgpack(torn) == scan_msgpack(data[:last]).__class__(2, last, cut - last)
        with pytest.raises(RecordError, match=f"torn tail of {cut - last} bytes at byte {last}"):
            list(iter_msgpack(torn, "log", tolerate_torn_tail=False))
    assert scan_msgpack(data).torn == 0 and scan_msgpack(data).frames == 3


def test_a_stream_torn_inside_its_magic_has_no_records(tmp_path: Path) -> None:
    with pytest.warns(TornTailWarning):
        assert list(iter_msgpack(MAGIC[:5])) == []
    path = tmp_path / "log.msgpack"
    path.write_bytes(MAGIC[:3])  # sniffed as msgpack, not as a JSONL line
    with pytest.warns(TornTailWarning):
        assert list(read_records(path)) == []
    assert scan_msgpack(MAGIC[:3]).torn == 3


def test_a_zero_filled_tail_is_torn() -> None:
    """Some filesystems leave a file extended but zero-filled after a crash; no record encodes to an
    empty frame, so zeros to the end are a torn tail."""
    data = encode_msgpack_stream(RECS)
    with pytest.warns(TornTailWarning) as w:
        assert _ids(list(iter_msgpack(data + bytes(4096)))) == ["c0", "c1", "c2"]
    assert w[0].message.size == 4096  # type: ignore[union-attr]


def test_corruption_in_a_whole_frame_is_an_error_wherever_it_is() -> None:
    data = encode_msgpack_stream(RECS)
    for i, start in enumerate(_frame_starts(data)):  # the last whole frame too
        bad = bytearray(data)
        bad[start + 4] = 0xC1  # a byte msgpack never uses
        with pytest.raises(RecordError, match=f"log: frame {i} \\(byte {start}\\)"):
            list(iter_msgpack(bytes(bad), "log"))


def test_an_empty_frame_before_other_bytes_is_corrupt_not_torn() -> None:
    data = encode_msgpack_stream(RECS[:1]) + struct.pack("<I", 0) + b"\x01\x02\x03\x04\x05"
    with pytest.raises(RecordError, match="frame 1"):
        list(iter_msgpack(data, "log"))


def test_jsonl_last_line_without_newline_is_torn_other_bad_lines_are_errors(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    write_records(path, RECS)
    whole = path.read_bytes()
    last_start = whole.rstrip(b"\n").rfind(b"\n") + 1
    for cut in (last_start + 1, last_start + 17, len(whole) - 2):
        path.write_bytes(whole[:cut])
        with pytest.warns(TornTailWarning) as w:
            assert _ids(list(read_records(path))) == ["c0", "c1"]
        assert w[0].message.where == "line 3" and w[0].message.size == cut - last_start  # type: ignore[union-attr]
        with pytest.raises(RecordError, match="torn tail"):
            list(read_records(path, tolerate_torn_tail=False))
    # a whole last line without its newline is a record, not a tail
    path.write_bytes(whole[:-1])
    assert _ids(list(read_records(path))) == ["c0", "c1", "c2"]
    # a line that ends with its newline and does not decode is corrupt, even the last one
    lines = whole.split(b"\n")
    lines[2] = lines[2][:-5]
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(RecordError, match=r"log\.jsonl:3"):
        list(read_records(path))
    obj = json.loads(lines[1])
    obj["output_ids"] = "nope"
    text = b"\n".join([lines[0], msgspec.json.encode(obj), lines[2]])
    with pytest.raises(RecordError, match="<stream>:2"):
        list(iter_jsonl(text.splitlines(keepends=True)))


def test_an_array_of_a_partial_element_is_a_record_error() -> None:
    """Found by fuzzing: an int32 array extension of 5 bytes made numpy's ValueError escape the reader."""
    raw = Codec().encode_msgpack(RECS[0])
    obj = msgspec.msgpack.decode(raw, ext_hook=lambda c, d: msgspec.msgpack.Ext(c, bytes(d)))
    obj["output_ids"] = msgspec.msgpack.Ext(1, b"\x01\x00\x00\x00\x02")
    payload = msgspec.msgpack.encode(obj)
    with pytest.raises(RecordError, match="5 bytes, not a multiple of 4"):
        list(iter_msgpack(MAGIC + struct.pack("<I", len(payload)) + payload, "log"))
