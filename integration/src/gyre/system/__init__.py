"""A run as a whole: its directory (`rundir.py`, `resume.py`, `diskfull.py`), the run and its attempts
(`run.py`, and `attempt.py`: build, start, watch, collect), where its processes start and what each cell
is given (`launch.py`, `gpus.py`), what is restarted in place (`supervise.py`), and the parts that ride
along (`runparts.py`; the held-out `evaluator.py`). May import every floor below it: cell, rollout,
measure, trajsvc, config, procs.
"""
