"""A warm-started model kept between the benchmark's calls on one machine.

Each GPU call of `h200_agentic.py` makes its model (`gyre-engine create-model`) and warm starts it, about
50 s on the H200. With `--model-cache DIR` (a folder that outlives the call, e.g. an ignored folder of the
working tree on a machine kept warm between calls) the first call makes the model in DIR/model and writes
DIR/made.json, what made it: shape, dtype, seed, warm-start steps and learning rate, and the warm start's
own figures. A later call asking for the same finds it and starts from it; a call asking for anything else
makes the model again in its place. The model's weights are safetensors, read by the engines and trainers
as any checkpoint is; made.json is JSON.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

MADE = "made.json"


def find(cache: Path, made: dict[str, Any]) -> tuple[Path, Any] | None:
    """(the cached model's folder, its warm start's figures) when `cache` holds a model made as `made`
    says, else None."""
    try:
        kept = json.loads((cache / MADE).read_text())
    except (OSError, ValueError):
        return None
    if kept.get("made") != made or not (cache / "model" / "config.json").is_file():
        return None
    return cache / "model", kept.get("warmstart")


def clear(cache: Path) -> None:
    """Forget what `cache` holds, before a model is made there."""
    (cache / MADE).unlink(missing_ok=True)
    shutil.rmtree(cache / "model", ignore_errors=True)
    cache.mkdir(parents=True, exist_ok=True)


def keep(cache: Path, made: dict[str, Any], warmstart: Any) -> None:
    """Record that `cache`/model was made as `made` says (written last: a call cut short leaves none)."""
    tmp = cache / (MADE + ".tmp")
    tmp.write_text(json.dumps({"made": made, "warmstart": warmstart}, indent=1, default=str) + "\n")
    tmp.replace(cache / MADE)
