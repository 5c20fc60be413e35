"""gyre-engine."""
