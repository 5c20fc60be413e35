"""Typed errors for every way a transfer can fail.

Mooncake reports every failure as a bare -1; gyre-xfer turns it into one of these, each naming the peer,
what was being moved and how long it waited. All derive from `XferError`, so a caller may catch one class.
"""

from __future__ import annotations


class XferError(Exception):
    """Base class of every gyre-xfer error."""


class TransportUnavailableError(XferError):
    """The transport cannot run in this environment (missing wheel, missing system library)."""


class PeerGoneError(XferError):
    """The peer's process is gone: its port refuses connections."""


class PeerTimeoutError(XferError):
    """The peer did not answer or make progress within the configured time (hung, stopped, overloaded)."""


class OutOfRangeError(XferError):
    """A transfer names bytes outside a registered region, locally or at the peer."""


class TransferFailedError(XferError):
    """The transport refused or failed the transfer for a reason it does not report (see its stderr log)."""


class ManifestError(XferError):
    """A snapshot manifest is malformed, inconsistent, or from an incompatible protocol version."""


class ShapeMismatchError(XferError):
    """A destination buffer does not match the manifest's name, shape or dtype."""


class SnapshotOverwrittenError(XferError):
    """The version being pulled was overwritten before the pull finished (its lease expired)."""


class ChecksumError(XferError):
    """Pulled bytes do not match the manifest's checksum."""


class ProtocolError(XferError):
    """A control message could not be decoded or answered with an error."""


class PublisherDeadError(XferError):
    """The publisher's serving thread died: subscribers can no longer pull, so publishing stops too."""
