"""Shared builders for gyre-traj tests. Token ids come from per-role bands so a failure reads as names:
system 1000s, user 2000s, tool 3000s, policy output 4000s."""

from __future__ import annotations

import numpy as np
from gyre_traj.records import Call, Delta, Role

SYS, USER, TOOL, OUT = 1000, 2000, 3000, 4000


def ids(band: int, *offsets: int) -> list[int]:
    return [band + o for o in offsets]


def call(
    cid: str,
    inp: list[int] | None,
    out: list[int],
    *,
    role: Role = Role.MAIN,
    agent: str = "main",
    execution: str = "e",
    delta: tuple[str, int, list[int]] | None = None,
    version: int = 0,
    t: float = 0.0,
) -> Call:
    return Call(
        execution_id=execution,
        call_id=cid,
        agent_id=agent,
        role=role,
        input_ids=None if inp is None else np.asarray(inp),
        input_delta=None if delta is None else Delta(delta[0], delta[1], np.asarray(delta[2])),
        output_ids=np.asarray(out),
        output_logprobs=-0.1 * (1 + np.arange(len(out))),
        weight_version=version,
        t_start=t,
        t_end=t + 1.0,
    )
