"""Shared by the hostile and fuzz tests: hostile frames for gyre-sched's decoders (valid messages, truncated
ones, real tags over values of any type, garbage, empty frames)."""

from __future__ import annotations

import typing
from typing import Any

import msgspec
from gyre_sched.protocol import (
    PROTOCOL_VERSION,
    CellLost,
    Codec,
    EngineAdd,
    EngineDrain,
    EngineDrained,
    EngineRemove,
    GetState,
    Heartbeat,
    Hello,
    Message,
    PeerKind,
    ReadyGroups,
    Reject,
    Role,
    SwitchCommand,
    SwitchDone,
    WaterLevel,
    Welcome,
)
from hypothesis import strategies as st

TAGS = [t.__struct_config__.tag for t in typing.get_args(Message)]

scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.binary(max_size=8),
)
value = st.recursive(scalar, lambda inner: st.lists(inner, max_size=4), max_leaves=8)

# Well-formed messages with small ids, so sequences can register cells, start switches and answer them.
ids = st.integers(0, 2)
valid: st.SearchStrategy[Message] = st.one_of(
    st.builds(
        Hello,
        st.sampled_from(PeerKind),
        protocol=st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION + 1, 0]),
        cell_id=ids,
        is_core=st.booleans(),
        capacity=st.integers(0, 20),
    ),
    st.builds(WaterLevel, st.integers(0, 40)),
    st.builds(ReadyGroups, st.integers(0, 20), st.integers(1, 8), step_open=st.booleans()),
    st.builds(SwitchDone, ids, st.sampled_from(Role), st.integers(0, 4)),
    st.builds(EngineDrained, ids),
    st.builds(Heartbeat, ids),
    st.just(GetState()),
    st.builds(SwitchCommand, st.integers(0, 4), st.sampled_from(Role)),
    st.builds(Welcome),
    st.builds(Reject, st.text(max_size=12)),
    st.builds(CellLost, ids),
    st.builds(EngineAdd, ids, st.text(max_size=12)),
    st.builds(EngineDrain, ids),
    st.builds(EngineRemove, ids, st.booleans()),
)
_codec = Codec()


@st.composite
def frame(draw: Any) -> bytes:
    kind = draw(st.sampled_from(["valid", "truncated", "tagged", "garbage", "empty"]))
    if kind == "valid":
        return _codec.encode(draw(valid))
    if kind == "truncated":
        data = _codec.encode(draw(valid))
        return data[: draw(st.integers(0, max(0, len(data) - 1)))]
    if kind == "tagged":  # a real tag followed by values of any type
        return msgspec.msgpack.encode([draw(st.sampled_from(TAGS)), *draw(st.lists(value, max_size=6))])
    if kind == "garbage":
        return bytes(draw(st.binary(min_size=1, max_size=40)))
    return b""


frames = st.lists(frame(), min_size=1, max_size=3)
"""One send: one frame or several (which the decoders must refuse as a whole)."""
