"""gyre-train: streaming trainer (core replica + satellites)."""

from gyre_base.version import package_version

__version__ = package_version("gyre-train", __file__)
