"""Types of the C extension `gyre_traj._ingest` (see `gyre_traj.native`)."""

from typing import Any

import numpy as np

class TreeState:
    n: int
    _pend_lo: int
    _lps_n: int
    _policy_count: int
    execution_id: str
    _ids: np.ndarray
    _lps: np.ndarray
    calls: dict[str, Any]
    order: list[str]
    _seg_lo: list[int]
    _seg_hi: list[int]
    _seg_groups: list[tuple[Any, Any, Any, Any, np.ndarray, int]]
    stats: Any

def extend_next(data: Any, trees: dict[str, Any], /) -> Any: ...
def setup(
    call_info: type,
    roles: dict[str, Any],
    schema_version: int,
    max_weight_version: int,
    no_pending: int,
    root: int,
    /,
) -> None: ...
