"""Regenerates branching.jsonl: one group of four small executions (compaction, sub-agents with a
compaction of their own, a retried call, one re-tokenization drift) and their scores, one of which is an
evaluation failure. Run: uv run python packages/gyre-traj/examples/make_example.py"""

from pathlib import Path

from gyre_traj.io import write_records
from gyre_traj.synth import SynthConfig, synth_group

CFG = SynthConfig(
    main_calls=14,
    max_context=1200,
    compactions=1,
    subagents=2,
    subagent_calls=3,
    subagent_compactions=1,
    retries=1,
    drifts=1,
    system_tokens=40,
    output_tokens=(4, 24),
    summary_tokens=24,
    seed=7,
)

if __name__ == "__main__":
    out = Path(__file__).with_name("branching.jsonl")
    write_records(out, list(synth_group(CFG, "query-0", 4, eval_failures=1, timeouts=1)))
    print(f"wrote {out}")
