"""What a run measured: the sampler of cell roles and engine activity (`metrics.py`, its readings in
`samples.py`), the trainer core's activity and how much training overlapped rollout (`trainwatch.py`), a
finished attempt's `metrics.json` (`runmetrics.py`), the gyre-sched simulator's prediction for a run
config (`predict.py`), the arms of a comparison and their table (`arms.py`), and the physical floors of
switches and weight pushes (`floors.py`). Everything comes in as data or over the components' own
clients. May import trajsvc, config and procs; not rollout, cell, system or above.
"""
