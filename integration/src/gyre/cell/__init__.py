"""One cell process (`gyre cell`): its rollout engine (gyre-engine, or an SGLang server through
`sglang_cell.py`) and its trainer replica (gyre-train's core, built from the model directory's whole HF
config, or a satellite), switched between rollout and training by gyre-sched (`cell.py`). `args.py` holds
the settings `gyre run` writes for it; `ranks.py` starts the other ranks of a multi-rank trainer (`[cell]
tensor_parallel`, `pipeline_parallel`), whose rank 0 is the cell's process. May import config and procs; nothing else of gyre.
"""
