"""gyre-engine: an embedded rollout engine that speaks SGLang's native HTTP protocol (extra `server`), and
the client and launcher for SGLang itself (base install, no torch)."""

__version__ = "0.4.0"
