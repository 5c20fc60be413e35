"""Running executions: the rollout driver (`driver.py`: batches under gyre-sched's admission, hard
timeouts, scores and call counts to the trajectory service), the harnesses that run one execution
(`harnesses.py`: the built-in agent, Claude Code, any command line; each checks its own `[agent]` keys),
the agents (`agents/`), the tasks and their scoring (`tasks/`), the executions of a held-out evaluation
(`evalset.py`) and the supervised warm start on the built-in tasks (`warmstart.py`).

Floors inside: driver | evalset | warmstart > harnesses > agents > tasks. May import trajsvc, config and
procs; not cell, measure, system or above.
"""
