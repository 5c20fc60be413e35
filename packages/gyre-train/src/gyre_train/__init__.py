"""gyre-train: streaming trainer (core replica + satellites)."""

__version__ = "0.4.0"
