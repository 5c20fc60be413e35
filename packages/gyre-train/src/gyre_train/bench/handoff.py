"""Gradient hand-off per micro-batch, the path gyre-train uses against the one it replaced, side by side
in one run between two processes (`gyre-train bench --cases handoff`).

A sender process (`python -m gyre_train.bench.handoff --peer ADDRESS ...`) holds a float32 gradient of
`numel` elements, as a satellite does after its backward pass; the bench process plays the core, with a
float32 sum. For each round the sender hands the same gradient over once on every path, in turn, and
times it from the moment it starts writing until it has the core's ack (its write, the control message,
the core's read and addition into its sum, the reply): seconds per micro-batch, medians over rounds.

- `xfer-<transport>-<dtype>`: gyre-train's path (`handoff.GradStaging` -> `Gradient` header over ZeroMQ
  -> `handoff.GradReader` + `shardsum.ShardSum`): Mooncake TCP (the code RDMA clusters run) or
  same-host shared memory, float32 or bfloat16 on the wire.
- `old-zmq-frame-float32` and `old-shm-float32`, the **baseline that gyre-train no longer ships**: the
  whole float32 vector as one raw ZeroMQ frame, or written into a /dev/shm segment the core maps and adds
  from in place. Kept here only to be measured against.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import msgspec
import numpy as np
import torch
import zmq
from gyre_base.sockets import make_socket
from gyre_xfer.shm import SHM_DIR
from gyre_xfer.transport import Config, open_transport

from gyre_train.handoff import GradReader, GradStaging, wire_dtype
from gyre_train.protocol import GradShard
from gyre_train.shardsum import ShardSum

NEW = tuple(f"xfer-{t}-{d}" for t in ("mooncake", "shm") for d in ("float32", "bfloat16"))
OLD = ("old-zmq-frame-float32", "old-shm-float32")
PATHS = NEW + OLD


class Handoff(msgspec.Struct, frozen=True, array_like=True):
    """Sender -> core: one micro-batch's gradient on `path` (`shard` for the gyre-xfer paths; the old
    ZeroMQ path sends the vector as the next frame; the old shared-memory path names its segment)."""

    path: str
    round: int
    shard: GradShard | None = None
    shm_name: str = ""


def _parse_path(path: str) -> tuple[str, str]:
    _, transport, dtype = path.split("-")
    return transport, dtype


def sender(peer: str, numel: int, rounds: int) -> int:
    """The satellite's side: hand the same gradient over on every path, `rounds` times, timing each."""
    torch.set_num_threads(1)
    grad = torch.from_numpy(np.random.default_rng(0).standard_normal(numel).astype(np.float32))
    transports = {k: open_transport(Config(kind=k)) for k in ("mooncake", "shm")}
    staging = {
        p: GradStaging(transports[_parse_path(p)[0]], numel, _parse_path(p)[1], bucket_bytes=16 << 20)
        for p in NEW
    }
    old_region = transports["shm"].alloc(4 * numel)
    assert old_region.array is not None
    old_buf = old_region.array.view(np.float32)[:numel]
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = make_socket(ctx, zmq.DEALER)
    sock.connect(peer)
    enc = msgspec.msgpack.Encoder()
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    try:
        for r in range(rounds):
            for p in PATHS:
                t0 = time.perf_counter()
                if p in staging:
                    staging[p].slot(0).copy_(grad)  # rounds to bf16 on the way if that is the wire dtype
                    frames: list[Any] = [enc.encode(Handoff(p, r, staging[p].describe(0, rank=0)))]
                elif p == "old-shm-float32":
                    np.copyto(old_buf, grad.numpy())
                    frames = [enc.encode(Handoff(p, r, shm_name=old_region.desc.shm_name))]
                else:
                    frames = [enc.encode(Handoff(p, r)), memoryview(grad.numpy()).cast("B")]
                sock.send_multipart(frames, copy=False)
                if not sock.poll(120_000):
                    raise TimeoutError(f"the core did not ack {p} round {r}")
                if sock.recv() != b"ok":
                    raise RuntimeError(f"the core refused {p} round {r}")
                times[p].append(time.perf_counter() - t0)
        sock.send_multipart([b"times", msgspec.json.encode(times)])
    finally:
        sock.close()
        ctx.term()
        for s in staging.values():
            s.close()
        for t in transports.values():
            t.close()
    return 0


def run(numel: int, rounds: int, timeout_s: float = 600.0) -> dict[str, Any]:
    """The core's side: start the sender, read and sum every hand-off, and return the figures."""
    torch.set_num_threads(1)
    transports = {k: open_transport(Config(kind=k)) for k in ("mooncake", "shm")}
    readers = {p: GradReader(transports[_parse_path(p)[0]], numel, _parse_path(p)[1]) for p in NEW}
    sums = {p: ShardSum(numel, torch.device("cpu"), wire_dtype(p.rsplit("-", 1)[1])) for p in PATHS}
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = make_socket(ctx, zmq.ROUTER)
    sock.bind("tcp://127.0.0.1:0")
    address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    cmd = [sys.executable, "-m", "gyre_train.bench.handoff", "--peer", address, "--numel", str(numel),
           "--rounds", str(rounds)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    dec = msgspec.msgpack.Decoder(Handoff)
    mapped: dict[str, np.ndarray[Any, Any]] = {}
    read_s: dict[str, list[float]] = {p: [] for p in PATHS}
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if not sock.poll(1000):
                if proc.poll() is not None or time.monotonic() > deadline:
                    err = proc.stderr.read().decode(errors="replace")[-3000:] if proc.stderr else ""
                    raise RuntimeError(f"hand-off sender stopped (exit {proc.poll()}): {err}")
                continue
            ident, head, *rest = sock.recv_multipart(copy=False)
            if bytes(head.buffer) == b"times":
                times: dict[str, list[float]] = msgspec.json.decode(bytes(rest[0].buffer))
                break
            msg = dec.decode(head.buffer)
            t0 = time.perf_counter()
            if msg.shard is not None:
                sums[msg.path].add(1, msg.round, readers[msg.path].read(msg.shard))
            elif msg.shm_name:
                if msg.shm_name not in mapped:
                    mm = np.memmap(os.path.join(SHM_DIR, msg.shm_name), dtype=np.uint8, mode="r+")
                    mapped[msg.shm_name] = mm[: 4 * numel].view(np.float32)
                sums[msg.path].add(1, msg.round, mapped[msg.shm_name])  # added from the mapping in place
            else:
                sums[msg.path].add(1, msg.round, np.frombuffer(rest[0].buffer, dtype="<f4"))
            read_s[msg.path].append(time.perf_counter() - t0)
            sock.send_multipart([ident, b"ok"])
        proc.wait(timeout=60)
    finally:
        sock.close()
        ctx.term()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        for r in readers.values():
            r.close()
        for t in transports.values():
            t.close()
    # Every path summed the same gradient `rounds` times; the float32 paths to the same bits.
    totals = {p: sums[p].total(1, rounds) for p in PATHS}
    ref = totals["old-zmq-frame-float32"]
    assert ref is not None
    paths = []
    for p in PATHS:
        total = totals[p]
        assert total is not None
        itemsize = 2 if p.endswith("bfloat16") else 4
        paths.append({
            "path": p,
            "bytes_per_mb": itemsize * numel,
            "s_per_mb": statistics.median(times[p]),
            "s_per_mb_runs": times[p],
            "core_read_and_add_s": statistics.median(read_s[p]),
            "gbps": itemsize * numel / statistics.median(times[p]) / 1e9,
            "sum_equals_float32": bool(torch.equal(total, ref)),
        })  # fmt: skip
    return {
        "case": "handoff",
        "numel": numel,
        "rounds": rounds,
        "paths": paths,
        "grad_handoff_bytes_per_mb": {q["path"]: q["bytes_per_mb"] for q in paths},
        "grad_handoff_s_per_mb": {q["path"]: q["s_per_mb"] for q in paths},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="gradient hand-off sender (started by gyre-train bench)")
    ap.add_argument("--peer", required=True)
    ap.add_argument("--numel", type=int, required=True)
    ap.add_argument("--rounds", type=int, required=True)
    args = ap.parse_args(argv)
    return sender(args.peer, args.numel, args.rounds)


if __name__ == "__main__":
    sys.exit(main())
