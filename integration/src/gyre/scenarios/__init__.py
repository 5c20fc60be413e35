"""Whole runs with something around them: `gyre demo` (`demo.py`: the warm start, then RL that learns the
built-in tasks, with a held-out evaluation), `gyre chaos` (`chaos.py`: a run under injected faults and
what it survived) and `gyre compare` (`compare.py`: one workload under several policies, beside the
simulator's prediction). May import system and every floor below it.
"""
