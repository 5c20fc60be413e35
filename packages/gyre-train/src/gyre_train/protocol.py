"""Messages between the trainer core and its satellites (ZeroMQ DEALER -> core ROUTER, msgspec).

Every request is one tagged, frozen struct in the first frame, decoded by one typed decoder over the
`Request` union; every reply likewise over `Reply`. A micro-batch's token and loss arrays follow as raw
buffer frames described by `ArraySpec`s in the header, never pickled. A gradient never crosses ZeroMQ:
the `Gradient` header names, per rank, the gyre-xfer region and buckets it lies in (`GradShard`), and the
core reads them over Mooncake or shared memory. `Hello` carries `PROTOCOL`; a mismatch is refused with an
`ErrorReply`. At the end: the messages rank 0 of a multi-rank cell sends its other ranks (`CellCommand`,
answered by `RankReply`), which never leave the cell.
"""

from __future__ import annotations

import enum

import msgspec
from gyre_xfer.protocol import RegionDesc

PROTOCOL = 5
"""5: a one-rank satellite beside a multi-rank core (`Welcome.whole_publisher`, `Fetch.whole`); 4: `Welcome.model_config` and `RankSetup.model_config` carry the whole HF config (`ModelConfig` JSON
format 2); 3: gradients through gyre-xfer (`Gradient.shards`), cell shapes in `Hello`/`Welcome`; 2: the
shared-memory gradient buffer (gone); 1: first release."""


class ErrorCode(enum.IntEnum):
    PROTOCOL = 1
    """Wrong protocol version or an undecodable message."""
    UNKNOWN_REPLICA = 2
    """A request from a replica that never said hello (or was declared dead)."""
    BAD_GRADIENT = 4
    """A gradient header that does not describe this core's shards (ranks, dtype, sizes, buckets)."""
    BAD_REQUEST = 5
    """A request that decoded but could not be served (the core logged why and carries on)."""


class Refusal(enum.IntEnum):
    """Why a `Submit`, `OpenStep`, `AddMicrobatches` or `CloseStep` was refused (in `Ack.refusal`);
    nothing changed in every case."""

    NONE = 0
    OUT_OF_ORDER = 1
    """Not the queue position the core expects next (a repeat or a gap)."""
    INBOX_FULL = 2
    """The core holds `CoreConfig.inbox` mini-batches already: submit again later (retryable)."""
    MALFORMED = 3
    """A micro-batch or its frames failed the checks (`wire.MicroBatchError`), or a count is invalid."""
    NOT_OPEN = 4
    """No open step has this number (never opened, closed already, or trained)."""
    COUNT_MISMATCH = 5
    """`CloseStep.microbatches` differs from the number of micro-batches the step was given."""


class ArraySpec(msgspec.Struct, frozen=True, array_like=True):
    """One raw frame: name, numpy dtype string (e.g. "<f4"), shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]


class CellShape(msgspec.Struct, frozen=True, array_like=True):
    """How a cell's ranks split the model: tensor x pipeline x data parallel (world = tp * pp * dp). A
    satellite cell of its core's shape hands rank r's gradient shard to core rank r; a one-rank satellite
    beside a core of one pipeline stage hands its whole gradient, of which each core rank takes its part
    (`satellite_refusal` says which shapes are refused)."""

    def __str__(self) -> str:
        return f"tp {self.tp} x pp {self.pp} x dp {self.dp}"

    tp: int = 1
    pp: int = 1
    dp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp


def satellite_refusal(sat: CellShape, core: CellShape) -> str | None:
    """Why a satellite cell of shape `sat` cannot train beside a core of shape `core` (None if it can):
    the same shape (rank to rank), or one rank beside a core of one pipeline stage (each core rank takes
    its part of the whole gradient). A split satellite beside a core of another shape would need its
    shards gathered and split again: refused."""
    if sat == core or (sat == CellShape() and core.pp == 1):
        return None
    if sat == CellShape():
        return (
            f"a one-rank satellite beside a core of {core}: each core rank takes its part of the whole "
            "gradient, which needs a core of one pipeline stage"
        )
    return (
        f"a satellite cell of {sat} beside a core of {core}: a satellite is the core's shape (rank r hands "
        "its gradient shard to core rank r) or one rank (its whole gradient, split by every core rank)"
    )


class Bucket(msgspec.Struct, frozen=True, array_like=True):
    """Elements [offset, offset + numel) of a rank's gradient shard, moved as one transfer."""

    offset: int
    numel: int


class GradShard(msgspec.Struct, frozen=True, array_like=True):
    """Where one rank's shard of a micro-batch gradient lies, for the core rank of the same number to
    read: `numel` elements of `dtype` (the wire dtype) at byte `offset` of the sender's gyre-xfer region
    `region`, reached at `endpoint` (a Mooncake segment name, or the shared-memory host tag), in
    `buckets` that tile [0, numel) in order."""

    rank: int
    endpoint: str
    region: RegionDesc
    offset: int
    dtype: str
    numel: int
    buckets: tuple[Bucket, ...]


# ---- requests (satellite -> core) -------------------------------------------------------------------


class Hello(msgspec.Struct, frozen=True, array_like=True, tag="hello"):
    protocol: int
    replica: str
    cell: CellShape = CellShape()
    """The satellite cell's shape: the core's, or one rank beside a core of one pipeline stage."""


class Claim(msgspec.Struct, frozen=True, array_like=True, tag="claim"):
    """Ask for a micro-batch. The core may hold the reply until work exists (long poll)."""

    replica: str
    version: int
    """Weight version the replica holds now (-1 before its first snapshot pull)."""
    hold: bool = True
    """Long-poll when there is no work; False: answer `Idle` at once (a data-parallel cell filling the
    rest of a round)."""


class Gradient(msgspec.Struct, frozen=True, array_like=True, tag="grad"):
    """A micro-batch's gradient is ready: `shards[r]` says where rank r's shard lies (one per rank of the
    cell). No frames follow; the satellite leaves the regions untouched until the reply."""

    replica: str
    batch: int
    index: int
    version: int
    shards: tuple[GradShard, ...]
    metrics: dict[str, float] = {}


class Heartbeat(msgspec.Struct, frozen=True, array_like=True, tag="beat"):
    replica: str


class Goodbye(msgspec.Struct, frozen=True, array_like=True, tag="bye"):
    """The replica leaves; `returned` lists claims it gives back unfinished (batch, index)."""

    replica: str
    returned: tuple[tuple[int, int], ...] = ()


class Admit(msgspec.Struct, frozen=True, array_like=True, tag="admit"):
    """From the scheduler (or any controller): let `replica` claim micro-batches."""

    protocol: int
    replica: str


class Dismiss(msgspec.Struct, frozen=True, array_like=True, tag="dismiss"):
    """From the scheduler: stop giving `replica` work (it finishes the micro-batch it holds)."""

    protocol: int
    replica: str


class Submit(msgspec.Struct, frozen=True, array_like=True, tag="submit"):
    """From the trajectory service: mini-batch number `seq` (the core's queue position it must take)
    whole, followed by the raw frames of every micro-batch's arrays, in order: `OpenStep`,
    `AddMicrobatches` and `CloseStep` in one message (all or nothing)."""

    protocol: int
    seq: int
    microbatches: tuple[tuple[ArraySpec, ...], ...]
    executions: int = 1
    """Divide the summed gradient by this (1: the weights are normalized over the whole batch already)."""


class OpenStep(msgspec.Struct, frozen=True, array_like=True, tag="open"):
    """From the trajectory service: open step `seq` (the core's next queue position) before its groups
    are ready; give it micro-batches with `AddMicrobatches` and end it with `CloseStep`."""

    protocol: int
    seq: int


class AddMicrobatches(msgspec.Struct, frozen=True, array_like=True, tag="add"):
    """More micro-batches for open step `seq`, claimed as soon as the step trains; followed by the raw
    frames of every micro-batch's arrays, in order. Their loss weights must not yet be divided by the
    step's execution count (`CloseStep.executions` does that)."""

    protocol: int
    seq: int
    microbatches: tuple[tuple[ArraySpec, ...], ...]


class CloseStep(msgspec.Struct, frozen=True, array_like=True, tag="close"):
    """Step `seq` is whole: `microbatches` in all (as added), and its summed gradient is divided by
    `executions` (the step's executions with loss tokens; 1 = the weights are normalized already)."""

    protocol: int
    seq: int
    microbatches: int
    executions: int = 1


class Status(msgspec.Struct, frozen=True, array_like=True, tag="status"):
    protocol: int


Request = (
    Hello
    | Claim
    | Gradient
    | Heartbeat
    | Goodbye
    | Admit
    | Dismiss
    | Status
    | Submit
    | OpenStep
    | AddMicrobatches
    | CloseStep
)


# ---- replies (core -> satellite) --------------------------------------------------------------------


class Welcome(msgspec.Struct, frozen=True, array_like=True, tag="welcome"):
    protocol: int
    publisher: str
    """gyre-xfer publisher control address to pull snapshots from."""
    transport: str
    """gyre-xfer transport kind the publisher serves ("shm" or "mooncake")."""
    heartbeat_s: float
    model_config: str
    """JSON of the core's `ModelConfig` (`to_json`: its whole HF config): the satellite builds the same
    model once, at start."""
    loss: str
    """JSON of the core's gyre-traj `LossConfig`."""
    attention: str = "dense"
    chunk_budget: int = 0
    """Train micro-batches larger than this in chunks (0 = off), as the core does."""
    cell: CellShape = CellShape()
    """The core cell's shape (a satellite has the same, or is one rank)."""
    publishers: tuple[str, ...] = ()
    """Per rank r, the gyre-xfer publisher of core rank r's weights (satellite rank r pulls from it)."""
    wire_dtype: str = "float32"
    """The dtype gradients are handed over in ("float32" or "bfloat16")."""
    bucket_bytes: int = 64 << 20
    """Largest bucket of a gradient shard (one transfer)."""
    whole_publisher: str = ""
    """The gyre-xfer publisher of the whole model's weights (one-rank layout; the same snapshot versions
    as the ranks'): a one-rank satellite beside a multi-rank core pulls from it."""


class Assign(msgspec.Struct, frozen=True, array_like=True, tag="assign"):
    """One micro-batch; followed by one raw frame per `arrays` entry."""

    batch: int
    index: int
    version: int
    """Trainer weight version the gradient must be computed at."""
    snapshot: int
    """gyre-xfer snapshot version holding those weights."""
    arrays: tuple[ArraySpec, ...]
    attention: str = "dense"


class Idle(msgspec.Struct, frozen=True, array_like=True, tag="idle"):
    """No work for this replica now (not admitted, or nothing left to claim): claim again."""

    reason: str = ""


class Ack(msgspec.Struct, frozen=True, array_like=True, tag="ack"):
    accepted: bool
    reason: str = ""
    refusal: Refusal = Refusal.NONE
    """For a refused `Submit`: which refusal (`reason` says it in words)."""


class Shutdown(msgspec.Struct, frozen=True, array_like=True, tag="shutdown"):
    reason: str = ""


class ErrorReply(msgspec.Struct, frozen=True, array_like=True, tag="error"):
    code: ErrorCode
    message: str


class ReplicaInfo(msgspec.Struct, frozen=True, array_like=True):
    name: str
    admitted: bool
    ready: bool
    claims: int
    gradients: int
    join_s: float = -1.0
    """Admission to first accepted gradient (-1 until it has one)."""


class StepInfo(msgspec.Struct, frozen=True, array_like=True):
    """One step the core has accepted and not yet applied."""

    seq: int
    closed: bool
    """No more micro-batches will come (`CloseStep`, or a whole `Submit`)."""
    training: bool
    """The step in progress: its micro-batches are being claimed (only the oldest step trains)."""
    microbatches: int
    """Given so far (the final count once closed)."""
    queued: int
    """Not claimed by any replica yet (all of them while the step waits its turn)."""
    claimed: int
    """Being computed."""
    done: int
    """Gradients in."""
    executions: int = 1
    """The divisor given at close (1 while open)."""


class StatusReply(msgspec.Struct, frozen=True, array_like=True, tag="status_reply"):
    step: int
    version: int
    snapshot: int
    queue_position: int
    pending: int
    """Unclaimed micro-batches of the step in progress."""
    replicas: tuple[ReplicaInfo, ...]
    steps: tuple[StepInfo, ...] = ()
    """Every accepted step not yet applied, oldest (the one training, if any) first."""


Reply = Welcome | Assign | Idle | Ack | Shutdown | ErrorReply | StatusReply


def request_decoder() -> msgspec.msgpack.Decoder[Request]:
    """Typed decoder over every request; build one per socket-owning thread and reuse it."""
    return msgspec.msgpack.Decoder(Request)


def reply_decoder() -> msgspec.msgpack.Decoder[Reply]:
    """Typed decoder over every reply; build one per socket-owning thread and reuse it."""
    return msgspec.msgpack.Decoder(Reply)


# ---- inside a cell (rank 0 -> its other ranks, over the in-cell ZeroMQ link; `cellctl.py`) ------------


class RankSetup(msgspec.Struct, frozen=True, array_like=True, tag="setup"):
    """What every rank builds: the role's model, gradient hand-off and weights (sent once, at start)."""

    role: str
    """"core" or "satellite"."""
    model_config: str
    """JSON of the `ModelConfig`."""
    loss: str
    """JSON of the gyre-traj `LossConfig`."""
    attention: str
    chunk_budget: int
    device: str
    """"cpu" or "cuda" (rank r uses cuda:LOCAL_RANK)."""
    transport: str
    wire_dtype: str
    bucket_bytes: int
    optim: str = ""
    """Core: JSON of the `OptimConfig`."""
    publishers: tuple[str, ...] = ()
    """Satellite: core rank r's publisher, for each rank r."""
    verify_checksums: bool = False
    transfer_timeout_s: float = 30.0


class RoundItem(msgspec.Struct, frozen=True, array_like=True):
    """One micro-batch of a round: computed by data-parallel group `dp`; its arrays follow as frames."""

    dp: int
    index: int
    arrays: tuple[ArraySpec, ...]


class Compute(msgspec.Struct, frozen=True, array_like=True, tag="compute"):
    """Compute a round of micro-batches (at most one per data-parallel group) of step `batch`; a core
    rank adds its shard of each into its sum, a satellite rank stages it (slot = position in `items`)."""

    batch: int
    items: tuple[RoundItem, ...]


class Fetch(msgspec.Struct, frozen=True, array_like=True, tag="fetch"):
    """Core ranks: read this rank's shard of a satellite's gradient (or the whole gradient of a one-rank
    satellite) and add it into the sum."""

    batch: int
    index: int
    shard: GradShard
    seq: int = 0
    """Echoed in the reply (a reply to an earlier fetch that timed out is told apart)."""
    whole: bool = False
    """`shard` is a one-rank satellite's whole gradient: read it all and add this rank's part."""


class Pull(msgspec.Struct, frozen=True, array_like=True, tag="pull"):
    """Satellite ranks: pull snapshot `snapshot` (-1: the newest) of the matching core rank."""

    snapshot: int


class Apply(msgspec.Struct, frozen=True, array_like=True, tag="apply"):
    """Core ranks: divide the sum of step `batch`'s `n` micro-batches by `executions` and step AdamW."""

    batch: int
    n: int
    executions: int


class Publish(msgspec.Struct, frozen=True, array_like=True, tag="publish"):
    """Core ranks: publish this rank's weights as a new gyre-xfer snapshot."""


class SyncWeights(msgspec.Struct, frozen=True, array_like=True, tag="sync"):
    """Copy the weights of data-parallel index 0 to every data-parallel copy."""


class Gather(msgspec.Struct, frozen=True, array_like=True, tag="gather"):
    """Bring every rank's weights (`what` = "weights"), last summed gradient (`what` = "gradient") or
    AdamW moment (`what` = "exp_avg" or "exp_avg_sq") to rank 0 as whole tensors."""

    what: str
    batch: int = -1
    n: int = 0


class LoadWeights(msgspec.Struct, frozen=True, array_like=True, tag="load"):
    """Take this rank's part of the whole weights (`what` = "weights") or AdamW moment (`what` =
    "exp_avg" or "exp_avg_sq", every parameter's AdamW step count set to `step`) rank 0 broadcasts next
    (one-rank layout)."""

    what: str = "weights"
    step: float = 0.0


class Stop(msgspec.Struct, frozen=True, array_like=True, tag="stop"):
    """The cell is closing: the rank tears down and exits."""


CellCommand = RankSetup | Compute | Fetch | Pull | Apply | Publish | SyncWeights | Gather | LoadWeights | Stop


class RankFailure(enum.IntEnum):
    NONE = 0
    BAD_SHARD = 1
    """A `Fetch` whose shard does not fit this rank's (`handoff.BadShardError`)."""
    TRANSFER = 2
    """A `Fetch` whose transfer failed (`handoff.ShardTransferError`)."""
    FAILED = 3
    """Anything else (the rank logged the traceback)."""


class RankReply(msgspec.Struct, frozen=True, array_like=True, tag="rank_reply"):
    """A rank's answer to one command."""

    rank: int
    failure: RankFailure = RankFailure.NONE
    error: str = ""
    metrics: tuple[dict[str, float], ...] = ()
    """Compute: per item, the loss metrics (from the rank that computed the loss; {} elsewhere)."""
    shards: tuple[GradShard, ...] = ()
    """Compute on a satellite: per item, where this rank's shard is staged."""
    publisher: str = ""
    """Setup on a core: this rank's publisher address."""
    version: int = -1
    """Publish: the snapshot version; Pull: the version pulled."""
    value: float = 0.0
    """Apply: the gradient norm; Pull: seconds."""
    seq: int = 0
    """Fetch: the command's `seq`."""


class RankHello(msgspec.Struct, frozen=True, array_like=True, tag="rank_hello"):
    """A follower's first message on each in-cell channel (so rank 0 can address it)."""

    rank: int


def cell_command_decoder() -> msgspec.msgpack.Decoder[CellCommand]:
    return msgspec.msgpack.Decoder(CellCommand)


def rank_reply_decoder() -> msgspec.msgpack.Decoder[RankReply | RankHello]:
    return msgspec.msgpack.Decoder(RankReply | RankHello)
