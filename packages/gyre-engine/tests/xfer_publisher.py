"""A gyre-xfer snapshot publisher in its own process, for the engine's xfer tests (run as a script, never
imported by them). It opens a Mooncake and a shared-memory publisher, prints one JSON line with both
control addresses, then follows stdin: `publish KIND DIR`, `bad-shape KIND DIR`, `missing KIND DIR`, and
`churn KIND DIR0 DIR1` (publish DIR0, DIR1, DIR0, ... back to back until stdin closes). argv[1]: lease_s."""

from __future__ import annotations

import json
import sys
import threading

import numpy as np
from gyre_xfer.publisher import Publisher, PublisherConfig
from gyre_xfer.transport import Config, open_transport
from safetensors.numpy import load_file


def tensors_of(model_dir: str) -> dict[str, np.ndarray]:
    from pathlib import Path

    out: dict[str, np.ndarray] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def main() -> None:
    lease_s = float(sys.argv[1]) if len(sys.argv) > 1 else 60.0
    cfg = PublisherConfig(lease_s=lease_s, publish_wait_s=30.0)
    pubs = {
        kind: Publisher(open_transport(Config(kind=kind, progress_timeout_s=2)), cfg)
        for kind in ("mooncake", "shm")
    }
    print(json.dumps({k: p.address for k, p in pubs.items()}), flush=True)
    stop = threading.Event()
    churner: threading.Thread | None = None
    for line in sys.stdin:
        cmd, kind, model_dir, *rest = line.split()
        t = tensors_of(model_dir)
        if cmd == "churn":
            both, pub = [t, tensors_of(rest[0])], pubs[kind]

            def churn(both: list[dict[str, np.ndarray]] = both, pub: Publisher = pub) -> None:
                i = 0
                while not stop.is_set():
                    pub.publish(both[i % 2])
                    i += 1

            print(json.dumps({"version": pubs[kind].version}), flush=True)
            churner = threading.Thread(target=churn, daemon=True)
            churner.start()
            continue
        name = sorted(t)[0]
        if cmd == "bad-shape":  # one tensor one row short: the engine must refuse the whole version
            t[name] = np.ascontiguousarray(t[name][:-1])
        elif cmd == "missing":
            del t[name]
        print(json.dumps({"version": pubs[kind].publish(t), "changed": name}), flush=True)
    stop.set()
    if churner is not None:
        churner.join(timeout=30)
    for p in pubs.values():
        tr = p.transport
        p.close()
        tr.close()


if __name__ == "__main__":
    main()
