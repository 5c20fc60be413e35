"""gyre-traj's benchmark: ingest of a report-shaped execution (about 600 calls, context growing to
700k tokens, three compactions, eight sub-agents, retries) from full and from delta-encoded msgpack
records, against a plain `np.copyto` of the same bytes measured in the same run; packing and
de-duplication figures. Prints one JSON object as its last line."""

from gyre_traj.bench.run import run_bench

__all__ = ["run_bench"]
