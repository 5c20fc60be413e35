"""The run configuration and the run token: `runconfig.py` (the `gyre run` file loaded into checked frozen
sections; a setting shared with a package takes its default from the package's declaration) and
`runtoken.py` (the secret every process and link of a run shares). The bottom floor: imports no other part
of gyre, only the packages below (gyre-sched's table loader and workload, gyre-traj, gyre-xfer's auth).
"""
