"""Readers of the files a run's scalars go to, for the tests: TensorBoard event files (TFRecord frames of
tensorboardX's `Event` protobuf) and a W&B offline run's `.wandb` log (wandb's record log: a 7-byte
header, 32 KiB blocks of framed chunks, each record a `wandb_internal_pb2.Record`)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any


def tb_scalars(tb: Path) -> dict[str, dict[int, float]]:
    """Every scalar in the event files under `tb`: tag -> {step: value}."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, dict[int, float]] = {}
    for f in sorted(tb.glob("events.out.tfevents.*")):
        b, pos = f.read_bytes(), 0
        while pos + 12 <= len(b):
            (n,) = struct.unpack("<Q", b[pos : pos + 8])
            ev = Event.FromString(b[pos + 12 : pos + 12 + n])
            pos += 12 + n + 4
            for v in ev.summary.value:
                out.setdefault(v.tag, {})[ev.step] = v.simple_value
    return out


def wandb_history(run_file: Path) -> list[dict[str, Any]]:
    """The history rows (`wandb.log` calls) of an offline run's `run-*.wandb` file, in order."""
    from wandb.proto import wandb_internal_pb2

    b = run_file.read_bytes()
    assert b[:4] == b":W&B", f"{run_file} is not a W&B run log"
    block, pos, buf, rows = 32768, 7, b"", []
    while pos + 7 <= len(b):
        if block - pos % block < 7:  # the rest of a block too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", b[pos : pos + 7])
        if n == 0 and kind == 0:
            break
        buf += b[pos + 7 : pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):  # a whole record, or its last chunk
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(buf)
            buf = b""
            if rec.WhichOneof("record_type") == "history":
                rows.append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                )
    return rows
