"""gyre-traj: exact, de-duplicated training data from branching LLM-agent traces."""

__version__ = "0.2.1"
