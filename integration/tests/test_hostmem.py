"""The progress lines' host memory: /proc/meminfo and the children's resident sets, read from a /proc
tree laid out as Linux lays it out, and from this machine's own."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from gyre.procs import hostmem

MEMINFO = """MemTotal:       131911680 kB
MemFree:         1024000 kB
MemAvailable:   54857728 kB
Buffers:           10240 kB
Shmem:           3250585 kB
HugePages_Total:       0
"""


def _proc(tmp_path: Path, rss_kb: dict[int, int]) -> Path:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "meminfo").write_text(MEMINFO)
    for pid, kb in rss_kb.items():
        (proc / str(pid)).mkdir()
        (proc / str(pid) / "status").write_text(
            f"Name:\tpython3\nVmPeak:\t{kb * 2} kB\nVmRSS:\t{kb} kB\nRssAnon:\t{kb // 2} kB\n"
            f"RssFile:\t{kb // 4} kB\nRssShmem:\t{kb // 4} kB\n"
        )
    return proc


def test_summary_names_the_largest_live_children(tmp_path: Path) -> None:
    proc = _proc(tmp_path, {11: 24_536_678, 12: 23_068_672, 13: 6_396_314, 14: 1_048_576})
    pids = tmp_path / "pids.txt"
    pids.write_text("11 engine-1\n12 engine-0\n13 cell-0\n14 proxy\n99 cell-1\n")  # 99 is gone
    assert hostmem.children_rss(pids, proc) == {
        "engine-1": (24_536_678 * 1024, 12_268_339 * 1024),
        "engine-0": (23_068_672 * 1024, 11_534_336 * 1024),
        "cell-0": (6_396_314 * 1024, 3_198_157 * 1024),
        "proxy": (1_048_576 * 1024, 524_288 * 1024),
    }
    assert hostmem.summary(pids, 3, proc) == (
        "host 52.3 GiB available, shm 3.1; "
        "engine-1 23.4 (anon 11.7), engine-0 22.0 (anon 11.0), cell-0 6.1 (anon 3.1)"
    )


def test_summary_without_children_or_proc(tmp_path: Path) -> None:
    proc = _proc(tmp_path, {})
    assert hostmem.summary(tmp_path / "no-pids.txt", 3, proc) == "host 52.3 GiB available, shm 3.1"
    assert hostmem.summary(tmp_path / "no-pids.txt", 3, tmp_path / "no-proc") == ""


def test_this_machines_own_process() -> None:
    if not Path("/proc/self/status").exists():
        pytest.skip("no /proc here")
    rss, anon = hostmem.rss_bytes(os.getpid()) or (0, 0)
    assert rss >= anon > 10 << 20  # an interpreter with pytest holds more
