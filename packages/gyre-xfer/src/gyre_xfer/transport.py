"""The one API over both transports: register memory, describe it to peers, and move batches of byte
ranges between local regions and a peer's regions, with a deadline and a result per entry.

`open_transport(Config)` returns a Mooncake transport (TCP here, RDMA where present) or a same-host
shared-memory one; both check every range before any byte moves and raise or report typed errors. The
API's types live in `gyre_xfer.api` and are the same objects here.
"""

from __future__ import annotations

from .api import BatchResult, Config, EntryStatus, Op, Region, Transport, check_ranges

__all__ = [
    "BatchResult",
    "Config",
    "EntryStatus",
    "Op",
    "Region",
    "Transport",
    "check_ranges",
    "open_transport",
]


def open_transport(config: Config | None = None) -> Transport:
    """Open the transport `config.kind` names."""
    config = config or Config()
    if config.kind == "mooncake":
        from .mooncake import MooncakeTransport

        return MooncakeTransport(config)
    if config.kind == "shm":
        from .shm import ShmTransport

        return ShmTransport(config)
    raise ValueError(f"unknown transport kind {config.kind!r}: use 'mooncake' or 'shm'")
