"""gyre-sched: elastic rollout/training scheduler for long-horizon agent RL, and its simulator."""

__version__ = "0.2.0"
