"""The host memory a run's processes hold, for its progress lines: what the machine has available, its
shared memory, and the resident set of the largest children (from `<log_dir>/pids.txt`).

A machine that runs out of host memory has its kernel kill the largest process with SIGKILL, which
leaves nothing in that process's log; the progress lines before it say which process grew.
"""

from __future__ import annotations

from pathlib import Path

from gyre_base.meminfo import meminfo

GIB = 1 << 30


def rss_bytes(pid: int, proc: Path = Path("/proc")) -> tuple[int, int] | None:
    """The resident set of process `pid` and the anonymous part of it (its heap and private mappings,
    not shared memory or files); None once it is gone."""
    try:
        text = (proc / str(pid) / "status").read_text()
    except OSError:
        return None
    got = {"VmRSS": 0, "RssAnon": 0}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in got:
            got[key] = int(rest.split()[0]) * 1024
    return got["VmRSS"], got["RssAnon"]


def children_rss(pids_file: Path, proc: Path = Path("/proc")) -> dict[str, tuple[int, int]]:
    """`rss_bytes` of each live child listed in `pids_file` (lines of "pid name"), by name."""
    out: dict[str, tuple[int, int]] = {}
    try:
        lines = pids_file.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        pid, _, name = line.partition(" ")
        if not pid.isdigit():
            continue
        rss = rss_bytes(int(pid), proc)
        if rss is not None:
            out[name.strip() or pid] = rss
    return out


def summary(pids_file: Path, largest: int = 3, proc: Path = Path("/proc")) -> str:
    """The progress lines' figure ("" off Linux), e.g. "host 52.3 GiB available, shm 3.1; engine-1 23.4
    (anon 11.7), engine-0 22.0 (anon 11.0), cell-0 6.1 (anon 3.0)"."""
    info = meminfo(proc / "meminfo")
    if "MemAvailable" not in info:
        return ""
    top = sorted(children_rss(pids_file, proc).items(), key=lambda kv: -kv[1][0])[:largest]
    head = f"host {info['MemAvailable'] / GIB:.1f} GiB available, shm {info.get('Shmem', 0) / GIB:.1f}"
    parts = [f"{n} {rss / GIB:.1f} (anon {anon / GIB:.1f})" for n, (rss, anon) in top]
    return head + ("; " + ", ".join(parts) if parts else "")
