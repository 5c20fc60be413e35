"""gyre: the assembled system (config, process launch, rollout driver, the `gyre` command)."""

__version__ = "0.3.0"
