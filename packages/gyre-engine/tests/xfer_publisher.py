"""A gyre-xfer snapshot publisher in its own process, for the engine's xfer tests (run as a script, never
imported by them). It opens a Mooncake and a shared-memory publisher, prints one JSON line with both
control addresses, then follows stdin: `publish KIND DIR`, `bad-shape KIND DIR`, `missing KIND DIR`."""

from __future__ import annotations

import json
import sys

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
    pubs = {
        kind: Publisher(open_transport(Config(kind=kind, progress_timeout_s=2)), PublisherConfig())
        for kind in ("mooncake", "shm")
    }
    print(json.dumps({k: p.address for k, p in pubs.items()}), flush=True)
    for line in sys.stdin:
        cmd, kind, model_dir = line.split()
        t = tensors_of(model_dir)
        name = sorted(t)[0]
        if cmd == "bad-shape":  # one tensor one row short: the engine must refuse the whole version
            t[name] = np.ascontiguousarray(t[name][:-1])
        elif cmd == "missing":
            del t[name]
        print(json.dumps({"version": pubs[kind].publish(t), "changed": name}), flush=True)
    for p in pubs.values():
        tr = p.transport
        p.close()
        tr.close()


if __name__ == "__main__":
    main()
