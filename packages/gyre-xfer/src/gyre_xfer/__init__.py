"""gyre-xfer."""

__version__ = "0.1.0"
