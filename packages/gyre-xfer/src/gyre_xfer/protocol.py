"""Every message gyre-xfer sends: the snapshot control protocol (ZeroMQ, msgspec) and the records peers
exchange to address each other's memory (region, manifest, KV pool descriptors).

Requests and replies are tagged, frozen, array-like structs decoded by one typed decoder each; the
handshake carries `PROTOCOL_VERSION`. New fields are appended with defaults so releases keep talking.
"""

from __future__ import annotations

from enum import IntEnum

import msgspec

PROTOCOL_VERSION = 1


class TransportKind(IntEnum):
    MOONCAKE = 1
    SHM = 2


class ErrorCode(IntEnum):
    BAD_REQUEST = 1
    PROTOCOL_MISMATCH = 2
    NO_VERSION = 3
    UNKNOWN_LEASE = 4
    BUSY = 5


class RegionDesc(msgspec.Struct, frozen=True, array_like=True):
    """A registered memory region as a peer addresses it: Mooncake uses `addr` (the owner's virtual
    address), shared memory uses `shm_name`; `region_id` is unique within the owning transport."""

    region_id: int
    nbytes: int
    addr: int
    shm_name: str = ""


class TensorEntry(msgspec.Struct, frozen=True, array_like=True):
    """One named tensor of a snapshot: its bytes are region[offset : offset + nbytes]."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    crc32: int


class Manifest(msgspec.Struct, frozen=True, array_like=True):
    """One published version: where each tensor lies in the publisher's registered slot."""

    version: int
    incarnation: str
    transport: TransportKind
    endpoint: str
    region: RegionDesc
    tensors: tuple[TensorEntry, ...]
    protocol: int = PROTOCOL_VERSION


class KvPlane(msgspec.Struct, frozen=True, array_like=True):
    """One (layer, K or V) plane of a KV pool: `num_blocks` blocks of `block_nbytes` from `offset`
    in `regions[region]`."""

    region: int
    offset: int


class KvPoolDesc(msgspec.Struct, frozen=True, array_like=True):
    """A KV pool as a peer addresses it: planes are ordered layer-major, K then V (plane 2*l + kv)."""

    transport: TransportKind
    endpoint: str
    incarnation: str
    regions: tuple[RegionDesc, ...]
    planes: tuple[KvPlane, ...]
    num_layers: int
    num_blocks: int
    block_nbytes: int
    protocol: int = PROTOCOL_VERSION


class KvOffer(msgspec.Struct, frozen=True, array_like=True, tag="kv_offer"):
    """Source engine -> target engine (inside the engines' own protocol): these blocks, locked at the
    source until a receipt comes back, hold `num_tokens` tokens of `request_id`'s context, in order."""

    request_id: str
    pool: KvPoolDesc
    block_ids: tuple[int, ...]
    num_tokens: int


class KvReceipt(msgspec.Struct, frozen=True, array_like=True, tag="kv_receipt"):
    """Target -> source: which offered blocks arrived (the source may unlock all of them now)."""

    request_id: str
    arrived: tuple[int, ...]
    failed: tuple[int, ...]


# ---- snapshot control: requests ------------------------------------------------------------------


class Hello(msgspec.Struct, frozen=True, array_like=True, tag="hello"):
    protocol: int
    client: str


class Acquire(msgspec.Struct, frozen=True, array_like=True, tag="acquire"):
    """Lease the newest version >= `min_version`; the publisher will not overwrite it while leased."""

    min_version: int = 0


class Release(msgspec.Struct, frozen=True, array_like=True, tag="release"):
    lease_id: int


Request = Hello | Acquire | Release


# ---- snapshot control: replies -------------------------------------------------------------------


class Welcome(msgspec.Struct, frozen=True, array_like=True, tag="welcome"):
    protocol: int
    incarnation: str
    transport: TransportKind
    endpoint: str
    latest_version: int


class Lease(msgspec.Struct, frozen=True, array_like=True, tag="lease"):
    lease_id: int
    lease_s: float
    manifest: Manifest


class Released(msgspec.Struct, frozen=True, array_like=True, tag="released"):
    """`intact` is False when the slot was overwritten before release (the lease had expired)."""

    lease_id: int
    intact: bool


class ErrorReply(msgspec.Struct, frozen=True, array_like=True, tag="error"):
    code: ErrorCode
    message: str


Reply = Welcome | Lease | Released | ErrorReply


def request_decoder() -> msgspec.msgpack.Decoder[Request]:
    """A typed decoder over every request; build one per socket-owning thread and reuse it."""
    return msgspec.msgpack.Decoder(Request)


def reply_decoder() -> msgspec.msgpack.Decoder[Reply]:
    return msgspec.msgpack.Decoder(Reply)


def kv_pool_decoder() -> msgspec.msgpack.Decoder[KvPoolDesc]:
    return msgspec.msgpack.Decoder(KvPoolDesc)


def manifest_decoder() -> msgspec.msgpack.Decoder[Manifest]:
    return msgspec.msgpack.Decoder(Manifest)
