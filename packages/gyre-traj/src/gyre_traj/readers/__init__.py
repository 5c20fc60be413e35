"""Readers of other systems' traces: the common per-turn shape, verl's rollout dumps, slime's rollout
samples and logs of OpenAI-compatible (and Anthropic Messages) calls, each turned into gyre's `Call`s
and `Score`s with the exact token ids the policy saw and sampled. They never re-tokenize text: a trace
without ids is refused, naming what is missing. This package uses `gyre_traj.records` only;
`gyre_traj.io.read_records` picks the reader for a file.
"""

from gyre_traj.readers.messages import iter_messages
from gyre_traj.readers.perturn import iter_foreign
from gyre_traj.readers.slime import iter_slime
from gyre_traj.readers.verl import iter_verl

__all__ = ["iter_foreign", "iter_messages", "iter_slime", "iter_verl"]
