"""The trajectory service: TITO records from gyre-proxy in, packed steps out to gyre-train's core
(`service.py`, with its bookkeeping in `stepbook.py`); what each step trained (`ledger.py`) and the
proxy's record log read back after a crash (`recordlog.py`). May import config and procs (it needs
neither); above it the rollout driver hands it scores, and the system wires it up.
"""
