"""gyre-proxy: token-in/token-out HTTP front for black-box agent harnesses."""

__version__ = "0.1.0"
