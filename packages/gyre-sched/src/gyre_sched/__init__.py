"""gyre-sched: elastic rollout/training scheduler for long-horizon agent RL, and its simulator."""

from gyre_base.version import package_version

__version__ = package_version("gyre-sched", __file__)
