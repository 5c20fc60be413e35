"""The trained policy of a finished run as a Hugging Face model directory, `policy/` in the run directory:
gyre-train's export of the core's checkpoint (written after every applied step; the run waits for the
one of its last version), with the tokenizer of the model directory the run started from, so
`transformers.AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` load it and
gyre-engine or SGLang serve it.
"""

from __future__ import annotations

import json
from pathlib import Path

POLICY = "policy"


class NotExported(Exception):
    """The checkpoint or the tokenizer files are not there (gyre-train's `ExportError`, which says which)."""


def checkpoint_version(ckpt: Path) -> int | None:
    """The weight version of the checkpoint in `ckpt`, or None while there is none (or it is being
    replaced)."""
    try:
        return int(json.loads((ckpt / "state.json").read_text())["version"])
    except (OSError, ValueError, KeyError):
        return None


def export(ckpt: Path, out: Path, model_dir: Path) -> Path:
    """Write the checkpoint in `ckpt` to `out` as a model directory with `model_dir`'s tokenizer
    (`NotExported`: the checkpoint or the tokenizer is not there). gyre-train's export loads torch: only
    here, so reading a run's configuration does not."""
    from gyre_train.export import ExportError, export_checkpoint

    try:
        return export_checkpoint(ckpt, out, model_dir)
    except ExportError as exc:
        raise NotExported(str(exc)) from exc
