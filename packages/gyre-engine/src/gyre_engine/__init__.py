"""gyre-engine: an embedded rollout engine that speaks SGLang's native HTTP protocol (extra `server`), and
the client and launcher for SGLang itself (base install, no torch)."""

from gyre_base.version import package_version

__version__ = package_version("gyre-engine", __file__)
