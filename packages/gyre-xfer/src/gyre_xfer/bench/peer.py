"""The benchmark's second process: owns the source memory (Mooncake and shared memory) and a publisher.

It prints one JSON line describing its regions, then obeys one command per stdin line: "publish" (a new
snapshot version; answers "published <version> <seconds>") or "quit".
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from gyre_xfer.publisher import Publisher
from gyre_xfer.transport import Config, open_transport


def main() -> None:
    nbytes = int(sys.argv[1])
    snapshot_bytes = int(sys.argv[2])
    mc = open_transport(Config(kind="mooncake"))
    shm = open_transport(Config(kind="shm"))
    rng = np.random.default_rng(0)
    src = mc.alloc(nbytes)
    assert src.array is not None
    src.array[:] = rng.integers(0, 255, nbytes, dtype=np.uint8)
    ssrc = shm.alloc(nbytes)
    assert ssrc.array is not None
    ssrc.array[:] = src.array
    n_tensors = 64
    per = snapshot_bytes // n_tensors // 2
    weights = {f"layers.{i}.weight": rng.integers(0, 2**16, per, dtype=np.uint16) for i in range(n_tensors)}
    pub = Publisher(mc)
    print(
        json.dumps(
            {
                "endpoint": mc.endpoint,
                "addr": src.addr,
                "nbytes": nbytes,
                "shm_name": ssrc.desc.shm_name,
                "shm_endpoint": shm.endpoint,
                "control": pub.address,
            }
        ),
        flush=True,
    )
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "publish":
            t0 = time.perf_counter()
            v = pub.publish(weights, dtypes=dict.fromkeys(weights, "bfloat16"))
            print(f"published {v} {time.perf_counter() - t0:.6f}", flush=True)
        elif cmd == "quit":
            break
    pub.close()
    mc.close()
    shm.close()


if __name__ == "__main__":
    main()
