"""gyre-proxy: token-in/token-out HTTP front for black-box agent harnesses."""

from gyre_base.version import package_version

__version__ = package_version("gyre-proxy", __file__)
