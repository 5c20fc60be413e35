"""Every message round-trips through the one codec; bad frames are a ProtocolError, never a crash."""

from __future__ import annotations

import msgspec
import pytest
from gyre_sched.protocol import (
    Action,
    CellLost,
    CellView,
    Codec,
    Decision,
    EngineAdd,
    EngineDrain,
    EngineDrained,
    EngineRemove,
    GetState,
    Heartbeat,
    Hello,
    PeerKind,
    ProtocolError,
    ReadyGroups,
    Reject,
    Role,
    State,
    SwitchCommand,
    SwitchDone,
    WaterLevel,
    Welcome,
    Why,
)

MESSAGES = [
    Hello(PeerKind.CELL, cell_id=3, is_core=True, capacity=64, endpoint="http://127.0.0.1:30000"),
    Hello(PeerKind.PROXY),
    Welcome(),
    Reject("no"),
    Heartbeat(2, Role.TRAINING, 0.5),
    WaterLevel(10, (0.0, 60.0), (4, 6), (12.5,), (True,), paused=1),
    WaterLevel(0),
    ReadyGroups(5, 16, 3, True, 1.25),
    ReadyGroups(2, 16, 3, True, 1.25, batch_complete=True),
    SwitchDone(1, Role.TRAINING, 7),
    EngineDrained(1),
    GetState(),
    SwitchCommand(7, Role.ROLLOUT, False),
    EngineAdd(1, "http://x"),
    EngineDrain(1),
    EngineRemove(1, failed=True),
    CellLost(2),
    State(
        (CellView(0, True, Role.ROLLOUT, 64, 0.0),),
        3,
        1,
        (Decision(1.0, 0, Action.TO_TRAINING, "r", Why(unfinished=3, ready_groups=2), protects=3),),
    ),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: object) -> None:
    c = Codec()
    assert c.decode(c.encode(msg)) == msg  # type: ignore[arg-type]


def test_bad_frames() -> None:
    c = Codec()
    with pytest.raises(ProtocolError):
        c.decode(b"\xc1garbage")
    with pytest.raises(ProtocolError):
        c.decode(msgspec.msgpack.encode(["nope", 1]))
    with pytest.raises(ProtocolError):
        c.decode(msgspec.msgpack.encode(["switch", "x", 1]))
