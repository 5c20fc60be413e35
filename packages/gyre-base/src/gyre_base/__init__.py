"""gyre-base: the plumbing every gyre package shares, in one place at the bottom of the stack.

`token` (the run token: where it comes from, the loopback rule, the HTTP bearer check; standard library
only), `sockets` (ZeroMQ sockets made one way, bound and connected under the token with CURVE; needs the
`zmq` extra), `tables` (strict TOML/JSON/YAML table -> dataclass loading), `meminfo` (the host's memory, from
/proc/meminfo), `version` (the version a
package reports) and `testing` (helpers for the members' tests; `pytest_plugin` has their fixtures).
Nothing here imports another gyre package.
"""

from gyre_base.version import package_version

__version__ = package_version("gyre-base", __file__)
