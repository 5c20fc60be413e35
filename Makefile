# One entry point for the everyday jobs; .ci/run calls these same targets.
UV ?= uv
export UV_PYTHON_DOWNLOADS ?= never

.PHONY: install lint typecheck test bench wheels-check example

install:            ## the whole workspace, every extra (but the CUDA Mooncake wheel and sglang), dev and lint tools, as locked
	$(UV) sync --frozen --all-packages --all-extras --no-extra mooncake-cuda13 --no-extra sglang

lint:               ## ruff (lint and format check), and the import floors and no-circle contracts (import-linter)
	$(UV) run --frozen ruff check .
	$(UV) run --frozen ruff format --check .
	$(UV) run --frozen lint-imports

typecheck:          ## mypy over every member's src/
	$(UV) run --frozen mypy packages/*/src integration/src

test:               ## the README's test command
	$(UV) run --frozen pytest

bench:              ## quick benchmarks of every member that has one
	$(UV) run --frozen gyre-base bench --quick
	$(UV) run --frozen gyre-traj bench --quick
	$(UV) run --frozen gyre-sched bench --quick
	$(UV) run --frozen gyre-xfer bench --quick
	$(UV) run --frozen gyre-engine bench --quick
	$(UV) run --frozen gyre-proxy bench --quick
	$(UV) run --frozen python packages/gyre-engine/bench/handoff.py --context 4096 --reps 1
	$(UV) run --frozen gyre-train bench --quick

wheels-check:       ## build every wheel and smoke-install gyre-traj alone (with gyre-base), outside the workspace
	UV="$(UV)" bash .ci/wheels-check

example:            ## what a newcomer runs first
	$(UV) run --frozen gyre-traj inspect packages/gyre-traj/examples/branching.jsonl
