"""gyre: the assembled system and the `gyre` command.

Its subpackages stand on floors; each imports only the floors below it (`make lint` checks this with
import-linter, imports inside functions and under TYPE_CHECKING included, and that no import circle exists):

    cli                          the `gyre` command
    scenarios                    whole runs with something around them: demo, chaos, compare
    system                       a run: its directory, attempts, processes, placement, supervision
    cell | rollout | measure     one cell process; running executions; what a run measured
    trajsvc                      the trajectory service: records in, training data out
    config | procs               the run config and run token; child processes
"""

from gyre_base.version import package_version

__version__ = package_version("gyre", __file__)
