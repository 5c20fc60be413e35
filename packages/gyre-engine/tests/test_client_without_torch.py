"""The client, protocol and launcher import without torch or transformers (the proxy and trainer use them
from the base install)."""

from __future__ import annotations

import subprocess
import sys


def test_client_side_modules_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import gyre_engine.client, gyre_engine.launcher, gyre_engine.protocol, gyre_engine.cli\n"
        "heavy = [m for m in ('torch', 'transformers', 'starlette', 'uvicorn') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_safetensors_payload_helper_round_trips() -> None:
    import base64

    import numpy as np
    from gyre_engine.client import encode_safetensors_payload
    from safetensors.numpy import load

    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = load(base64.b64decode(encode_safetensors_payload({"w": arr})))
    assert np.array_equal(out["w"], arr)
