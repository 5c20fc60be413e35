"""A second process for the tests (run as a script, never imported by them): a snapshot publisher or a
KV pool owner over a real transport. It prints one JSON line describing itself, then follows stdin."""

from __future__ import annotations

import json
import sys
import threading

import msgspec
import numpy as np
from gyre_xfer.kv import KvPool
from gyre_xfer.publisher import Publisher, PublisherConfig
from gyre_xfer.transport import Config, open_transport


def fill_value(version: int, i: int) -> int:
    return (version * 7 + i) % 251


def block_pattern(layer: int, kv: int, block: int, nbytes: int) -> np.ndarray:
    seed = (layer * 2 + kv) * 100_003 + block
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def publisher(kind: str, args: dict[str, object]) -> None:
    tr = open_transport(Config(kind=kind, progress_timeout_s=2))
    cfg = PublisherConfig(
        control=str(args.get("control", "tcp://127.0.0.1:0")),
        lease_s=float(args.get("lease_s", 60.0)),  # type: ignore[arg-type]
        publish_wait_s=float(args.get("publish_wait_s", 60.0)),  # type: ignore[arg-type]
    )
    pub = Publisher(tr, cfg)
    n = int(args.get("tensors", 4))  # type: ignore[call-overload]
    per = int(args.get("tensor_bytes", 1 << 20))  # type: ignore[call-overload]
    bufs = [np.empty(per, np.uint8) for _ in range(n)]
    stop = threading.Event()

    def publish_one() -> int:
        v = pub.version + 1
        for i, b in enumerate(bufs):
            b.fill(fill_value(v, i))
        tensors = {f"t{i}": b for i, b in enumerate(bufs)}
        tensors["bf16"] = np.full((3, 5), v, np.uint16)
        return pub.publish(tensors, dtypes={"bf16": "bfloat16"})

    publish_one()
    print(json.dumps({"control": pub.address, "endpoint": tr.endpoint}), flush=True)

    def loop() -> None:
        while not stop.is_set():
            publish_one()

    th = threading.Thread(target=loop, daemon=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "publish":
            print(json.dumps({"version": publish_one()}), flush=True)
        elif cmd == "churn":  # publish new versions back to back until stdin closes
            th.start()
    stop.set()
    if th.is_alive():
        th.join(timeout=60)
    pub.close()
    tr.close()


def kvpool(kind: str, args: dict[str, object]) -> None:
    names = {k: str(args[k]) for k in ("hostname", "metadata_server") if k in args}
    tr = open_transport(Config(kind=kind, progress_timeout_s=2, **names))
    layers, blocks, nbytes = (int(args[k]) for k in ("layers", "blocks", "block_nbytes"))  # type: ignore[call-overload]
    pool = KvPool.allocate(tr, layers, blocks, nbytes)
    for layer in range(layers):
        for kv in range(2):
            for b in range(blocks):
                pool.block(layer, kv, b)[:] = block_pattern(layer, kv, b, nbytes)
    print(msgspec.json.encode(pool.describe()).decode(), flush=True)
    for _ in sys.stdin:
        pass
    pool.close()
    tr.close()


if __name__ == "__main__":
    role, kind = sys.argv[1], sys.argv[2]
    extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    {"publisher": publisher, "kvpool": kvpool}[role](kind, extra)
