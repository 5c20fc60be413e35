#!/usr/bin/env bash
# Issue 19's one device call, from the repository root, on a machine without uv or network: install the
# carried wheels (.whl/: msgspec, pyzmq, starlette, uvicorn, tensorboardx), put every workspace member's
# src/ on PYTHONPATH and run integration/bench/h200_run.py; results and logs go to $OUT.
# Extra arguments go to h200_run.py (e.g. --cpu --tiny to try it on a CPU box).
set -euo pipefail
OUT="${OUT:-$PWD/h200-run-out}"
mkdir -p "$OUT"
SITE="${GYRE_SITE:-/tmp/site}"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
fi
PP="$SITE"
for src in packages/*/src integration/src; do PP="$PP:$PWD/$src"; done
export PYTHONPATH="$PP${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OUT
python3 - <<'PY'
import importlib.util, sys
need = ["torch", "transformers", "tokenizers", "safetensors", "numpy", "httpx", "msgspec", "zmq",
        "starlette", "uvicorn", "matplotlib", "yaml", "tqdm"]
missing = [m for m in need if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"h200_run.sh: missing modules {missing}: carry their wheels in .whl/")
PY
python3 integration/bench/h200_run.py --out "$OUT" "$@" 2>&1 | tee "$OUT/h200-run.log"
