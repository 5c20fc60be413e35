"""Every message the scheduler sends or receives, as tagged, frozen msgspec Structs.

Peers (cells, the rollout driver, the trajectory service, the proxy, observers) connect a DEALER to the
scheduler's ROUTER and open with a `Hello` carrying `PROTOCOL_VERSION`; after that each frame is one
message of the `Message` union, decoded strictly by the one decoder built here. New fields are only ever
appended with defaults, so older and newer peers keep talking.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Annotated

import msgspec

PROTOCOL_VERSION = 1

# Value bounds checked by the decoder, so a well-formed frame with impossible numbers (a negative count,
# a NaN or infinite time) is a ProtocolError like any other bad frame, before anything acts on it.
Count = Annotated[int, msgspec.Meta(ge=0)]
Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=1e12)]
"""A finite, non-negative duration or age (NaN and infinities are refused)."""
Load = Annotated[float, msgspec.Meta(ge=0.0, le=1e6)]
Interval = Annotated[float, msgspec.Meta(gt=0.0, le=1e6)]
"""A finite, positive period (a heartbeat of 0, NaN or infinity would spin or silence a peer)."""
Lag = Annotated[float, msgspec.Meta(ge=-1e9, le=1e9)]
"""A finite policy-version lag (a report, not a count: negative is odd but not impossible)."""


class Role(IntEnum):
    """A cell's role. The only edges are those in `gyre_sched.cells.TRANSITIONS`."""

    ROLLOUT = 0
    DRAINING = 1  # stops taking new requests; the proxy moves its in-flight calls elsewhere
    TO_TRAINING = 2  # engine memory released, training replica loading (weights from the core)
    TRAINING = 3
    TO_ROLLOUT = 4  # training replica offloaded, engine resumed with the newest weights
    FAILED = 5


class PeerKind(IntEnum):
    CELL = 0
    DRIVER = 1  # the rollout driver: reports the water level
    TRAJ = 2  # the trajectory service: reports ready groups
    PROXY = 3  # gyre-proxy: receives engine add/drain/remove
    OBSERVER = 4  # CLIs and tests that only ask for state


class Action(IntEnum):
    TO_TRAINING = 0
    TO_ROLLOUT = 1


class Admission(IntEnum):
    """When the rollout driver may start a new batch, besides the bounds every policy shares (at most
    `max_ahead` batches ahead of the trainer; the staleness target). `gyre_sched.policy.batches_to_start`
    is the rule; the scheduler tells the driver its policy's admission in `Welcome`."""

    ROLLING = 0  # whenever the shared bounds allow, whatever is still running
    COHORT = 1  # only when nothing runs and every started batch is trained; then all the bounds allow


_S = {"frozen": True, "tag_field": "t", "omit_defaults": True, "array_like": True}


class Why(msgspec.Struct, frozen=True, omit_defaults=True):
    """The quantities a decision was taken on, so every switch can be explained after the fact."""

    unfinished: int = 0  # executions that need rollout capacity now (the water level)
    capacity_before: int = 0  # rollout capacity (concurrent executions) before the switch
    capacity_after: int = 0  # ... and after it
    ready_groups: int = 0  # groups ready and not yet trained for the step in progress
    batch_groups: int = 0  # groups in one optimizer step's batch
    held_s: float = 0.0  # how long ready_groups has stayed above the threshold
    staleness: float = 0.0  # mean policy-version lag of what was trained so far
    predicted_timeouts: float = 0.0  # unfinished executions expected to end at the timeout


class Decision(msgspec.Struct, frozen=True, omit_defaults=True):
    """One switch the policy chose, with the rule that fired and why."""

    at: float
    cell_id: int
    action: Action
    rule: str
    why: Why
    protects: int = 0  # rollout demand the switch promised to keep served


# ---- handshake -------------------------------------------------------------------------------------


class Hello(msgspec.Struct, tag="hello", **_S):
    """First message of every peer. Cells give their id, whether they are the core, and capacity."""

    kind: PeerKind
    protocol: int = PROTOCOL_VERSION
    cell_id: Annotated[int, msgspec.Meta(ge=-1)] = -1  # -1: not a cell
    is_core: bool = False
    capacity: Count = 0  # concurrent executions the cell serves at full speed when in rollout
    endpoint: str = ""  # the cell's engine URL, handed to the proxy on EngineAdd


class Welcome(msgspec.Struct, tag="welcome", **_S):
    """Reply to Hello. A cell starts in `role` (ROLLOUT unless the policy has a fixed split)."""

    protocol: int = PROTOCOL_VERSION
    role: Role = Role.ROLLOUT
    heartbeat_s: Interval = 1.0  # peers send a Heartbeat (or any message) at least this often
    admission: Admission = Admission.ROLLING  # for the driver: when the policy lets a batch start


class Reject(msgspec.Struct, tag="reject", **_S):
    """The scheduler refuses a message (bad version, unknown cell, illegal state); nothing changed."""

    reason: str


# ---- reports into the scheduler --------------------------------------------------------------------


class Heartbeat(msgspec.Struct, tag="hb", **_S):
    cell_id: int = -1
    role: Role = Role.ROLLOUT
    utilization: Load = 0.0


class WaterLevel(msgspec.Struct, tag="water", **_S):
    """From the rollout driver: unfinished executions, their ages, and durations that just ended."""

    unfinished: Count
    elapsed_s: tuple[Seconds, ...] = ()  # ages of unfinished executions, bucketed: bucket start times
    elapsed_count: tuple[Count, ...] = ()  # ... and how many executions in each bucket
    finished_s: tuple[Seconds, ...] = ()  # wall durations of executions that ended since the last report
    finished_timeout: tuple[bool, ...] = ()  # ... and whether each ended at the hard timeout
    paused: Count = 0
    admission_held: bool = False
    """A batch is left to start that the admission bound (`max_ahead`) holds back until the next step is
    applied."""


class ReadyGroups(msgspec.Struct, tag="ready", **_S):
    """From the trajectory service: groups ready and not yet trained (the step in progress first, then
    later steps once earlier batches are complete), and the step's state."""

    ready: Count
    batch_groups: Annotated[int, msgspec.Meta(ge=1)]
    version: Count = 0
    step_open: bool = False  # the trainer has begun accumulating this step and not yet applied it
    mean_staleness: Lag = 0.0
    batch_complete: bool | None = None
    """Every execution of the batch the next step trains has finished (Colocate's trigger), apart from
    how much of it is trained yet; None (an older sender): taken as `ready >= batch_groups`, which holds
    only while `ready` counts a complete batch's groups until the step is applied."""


class SwitchDone(msgspec.Struct, tag="switched", **_S):
    """From a cell: it finished the switch `decision` and now holds `role`."""

    cell_id: int
    role: Role
    decision: int


class EngineDrained(msgspec.Struct, tag="drained", **_S):
    """From the proxy: the engine of `cell_id` has no in-flight request left (moved or finished)."""

    cell_id: int


class GetState(msgspec.Struct, tag="get_state", **_S):
    pass


# ---- commands out of the scheduler -----------------------------------------------------------------


class SwitchCommand(msgspec.Struct, tag="switch", **_S):
    """To a cell: move to `role` (TRAINING or ROLLOUT); reply SwitchDone with the same `decision`."""

    decision: int
    role: Role
    is_core: bool = False


class EngineAdd(msgspec.Struct, tag="engine_add", **_S):
    """To the proxy: route new requests to this cell's engine."""

    cell_id: int
    endpoint: str


class EngineDrain(msgspec.Struct, tag="engine_drain", **_S):
    """To the proxy: send no new request to this engine; move or retry its in-flight calls; then reply
    EngineDrained. The scheduler proceeds after `drain_timeout_s` even without the reply."""

    cell_id: int


class EngineRemove(msgspec.Struct, tag="engine_remove", **_S):
    """To the proxy: the engine is gone (switched or failed); retry anything still routed to it."""

    cell_id: int
    failed: bool = False


class CellLost(msgspec.Struct, tag="cell_lost", **_S):
    """To the core cell: a training satellite failed; put its claimed micro-batches back in the queue."""

    cell_id: int


class CellView(msgspec.Struct, frozen=True):
    cell_id: int
    is_core: bool
    role: Role
    capacity: int
    since: float


class State(msgspec.Struct, tag="state", **_S):
    """Reply to GetState: every cell, the last observation's water level, and the decision log."""

    cells: tuple[CellView, ...]
    unfinished: int
    ready_groups: int
    decisions: tuple[Decision, ...] = ()


Message = (
    Hello
    | Welcome
    | Reject
    | Heartbeat
    | WaterLevel
    | ReadyGroups
    | SwitchDone
    | EngineDrained
    | GetState
    | SwitchCommand
    | EngineAdd
    | EngineDrain
    | EngineRemove
    | CellLost
    | State
)


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol."""


class Codec:
    """One encoder and one strict decoder over `Message`; build one per socket-owning thread."""

    def __init__(self) -> None:
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(Message)

    def encode(self, msg: Message) -> bytes:
        return self._enc.encode(msg)

    def decode(self, data: bytes | memoryview) -> Message:
        try:
            return self._dec.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"bad gyre-sched message: {exc}") from exc
