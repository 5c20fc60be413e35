"""/proc/meminfo read as Linux writes it: kB fields in bytes, counts as counts, and nothing where there is
no such file."""

from __future__ import annotations

from pathlib import Path

import pytest
from gyre_base.meminfo import available_bytes, meminfo

SAMPLE = """MemTotal:       131911680 kB
MemFree:         1024000 kB
MemAvailable:   54857728 kB
Shmem:           3250585 kB
HugePages_Total:       0
Hugepagesize:       2048 kB
"""


def test_fields_in_bytes_and_counts_as_they_are(tmp_path: Path) -> None:
    path = tmp_path / "meminfo"
    path.write_text(SAMPLE)
    got = meminfo(path)
    assert got["MemTotal"] == 131911680 * 1024 and got["Shmem"] == 3250585 * 1024
    assert got["HugePages_Total"] == 0 and got["Hugepagesize"] == 2048 * 1024
    assert available_bytes(path) == 54857728 * 1024


def test_no_file_reads_as_nothing(tmp_path: Path) -> None:
    assert meminfo(tmp_path / "none") == {} and available_bytes(tmp_path / "none") == 0


def test_this_machine() -> None:
    if not Path("/proc/meminfo").exists():
        pytest.skip("no /proc here")
    assert 0 < available_bytes() <= meminfo()["MemTotal"]
