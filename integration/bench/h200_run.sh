#!/usr/bin/env bash
# One GPU benchmark call, from the repository root, on a machine without uv or network: install the
# carried wheels (.whl/: msgspec, pyzmq, starlette, uvicorn, tensorboardx), put every workspace member's
# src/ on PYTHONPATH and run a bench script of integration/bench (default h200_run.py; `--script
# h200_agentic.py` for the agent-shaped workload); results and logs go to $OUT. Further arguments go to
# the script (e.g. --cpu --tiny to try it on a CPU box). With GYRE_CUDA_TESTS set to test files (the
# CUDA-only tests, skipped elsewhere), pytest runs them first (carry pytest, pluggy, iniconfig, hypothesis,
# sortedcontainers, attrs and pytest-timeout wheels too); their outcome goes to $OUT/cuda-tests.log and
# does not stop the bench.
set -euo pipefail
# The call's start: the script's --budget-s counts from here, the wheels' install and any CUDA tests with it.
GYRE_CALL_START="${GYRE_CALL_START:-$(date +%s.%N)}"
export GYRE_CALL_START
OUT="${OUT:-$PWD/h200-run-out}"
mkdir -p "$OUT"
SCRIPT=h200_run.py
if [ "${1:-}" = "--script" ]; then SCRIPT="$2"; shift 2; fi
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
if [ -n "${GYRE_CUDA_TESTS:-}" ]; then
    # shellcheck disable=SC2086  # a list of test files
    python3 -m pytest -q -rs -p no:cacheprovider -o addopts="--import-mode=importlib" $GYRE_CUDA_TESTS \
        2>&1 | tee "$OUT/cuda-tests.log" || true
fi
# The bench in the background so that a SIGTERM (a `timeout` around this script) reaches it: it then puts
# its runs' logs into $OUT before it stops.
python3 "integration/bench/$SCRIPT" --out "$OUT" "$@" > >(tee "$OUT/${SCRIPT%.py}.log") 2>&1 &
BENCH=$!
trap 'kill -TERM "$BENCH" 2>/dev/null' TERM INT
rc=0
wait "$BENCH" || rc=$?
if [ "$rc" -gt 128 ] && kill -0 "$BENCH" 2>/dev/null; then  # interrupted: wait for it to finish stopping
    rc=0
    wait "$BENCH" || rc=$?
fi
exit "$rc"
