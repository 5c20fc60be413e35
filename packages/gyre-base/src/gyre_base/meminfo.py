"""The host's memory as Linux reports it in /proc/meminfo (standard library only)."""

from __future__ import annotations

from pathlib import Path

MEMINFO = Path("/proc/meminfo")


def meminfo(path: Path = MEMINFO) -> dict[str, int]:
    """/proc/meminfo's fields, in bytes where the kernel gives kB and as they are where it gives counts
    (`HugePages_Total`); empty where there is no such file (not Linux, or no /proc)."""
    out: dict[str, int] = {}
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key.strip()] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def available_bytes(path: Path = MEMINFO) -> int:
    """The memory the kernel could give new allocations without swapping (`MemAvailable`), 0 where it
    does not say."""
    return meminfo(path).get("MemAvailable", 0)
