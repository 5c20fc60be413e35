"""gyre-xfer: bulk bytes between processes and hosts (weight snapshots, KV-cache blocks) over Mooncake
Transfer Engine or same-host shared memory."""

from gyre_base.version import package_version

__version__ = package_version("gyre-xfer", __file__)
