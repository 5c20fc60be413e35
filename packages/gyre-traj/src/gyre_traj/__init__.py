"""gyre-traj: exact, de-duplicated training data from branching LLM-agent traces.

The public API: records (`Call`, `Score`, ...), `read_records` / `write_records` (gyre's own streams and
other systems' traces), the trajectory trees (`Forest`), selection, advantages, packing, and the policy
loss. The loss names need PyTorch (`pip install 'gyre-traj[torch]'`) and are imported on first use, so
`import gyre_traj` never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gyre_base.version import package_version

from gyre_traj.io import FORMATS, RecordWriter, TornTailWarning, read_records, write_records
from gyre_traj.pack import PackConfig, PackedBatch, PackError, PackItem, pack
from gyre_traj.records import Call, CallBatch, Delta, EvalStatus, RecordError, Role, Score
from gyre_traj.select import Selection, SelectionConfig, select
from gyre_traj.tree import ExecutionTree, Forest
from gyre_traj.weights import AdvantageConfig, AdvantageStats, group_advantages

if TYPE_CHECKING:
    from gyre_traj.loss import (
        LossConfig,
        TorchBatch,
        combine_metrics,
        policy_loss,
        target_logprobs,
        target_logprobs_entropy,
    )

_TORCH_NAMES = frozenset(
    {
        "LossConfig",
        "TorchBatch",
        "combine_metrics",
        "policy_loss",
        "target_logprobs",
        "target_logprobs_entropy",
    }
)

__all__ = [
    "FORMATS",
    "AdvantageConfig",
    "AdvantageStats",
    "Call",
    "CallBatch",
    "Delta",
    "EvalStatus",
    "ExecutionTree",
    "Forest",
    "LossConfig",
    "PackConfig",
    "PackError",
    "PackItem",
    "PackedBatch",
    "RecordError",
    "RecordWriter",
    "Role",
    "Score",
    "Selection",
    "SelectionConfig",
    "TorchBatch",
    "TornTailWarning",
    "__version__",
    "combine_metrics",
    "group_advantages",
    "pack",
    "policy_loss",
    "read_records",
    "select",
    "target_logprobs",
    "target_logprobs_entropy",
    "write_records",
]


def __getattr__(name: str) -> Any:
    """The loss names, from `gyre_traj.loss` on first use (it imports torch; without torch installed
    the ImportError names the extra to install)."""
    if name in _TORCH_NAMES:
        value = getattr(importlib.import_module("gyre_traj.loss"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'gyre_traj' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _TORCH_NAMES)


__version__ = package_version("gyre-traj", __file__)
