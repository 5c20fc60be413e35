"""What an execution is asked to do and how it is scored: the built-in question families (`qa.py`: the
tool call and the final answer as unit tests, partial scores) and the coding tasks scored by hidden unit
tests in the working directory (`coding.py`). An evaluation failure is never a score of 0. May import
config and procs; it needs neither.
"""
