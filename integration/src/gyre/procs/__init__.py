"""Child processes: `group.py` starts them in their own session, dying with their parent, logs and watches
them and stops them in order; `nospace.py` says how a process that cannot write for want of space is told
apart from a crash and how it exits. The bottom floor beside `config`: imports nothing of gyre.
"""
