"""A cell's ranks never wait forever for one another: over the real in-cell ZeroMQ link, rank 0 gets a
typed error from a rank that does not answer, a rank that hears nothing from rank 0 ends its process,
and the launcher takes every rank down when one fails (as torchrun does)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from gyre_train.cellctl import LeaderLink, RankSilentError
from gyre_train.protocol import Publish
from gyre_train.threads import THREAD_DIED

FOLLOWER = textwrap.dedent(
    """
    import sys
    from gyre_train.cellctl import FollowerLink, LinkAddresses
    link = FollowerLink(LinkAddresses(*sys.argv[1:4]), 1, dead_after_s=1.0)
    print("connected", flush=True)
    while True:
        link.recv(0.2)  # reads commands and never answers them
    """
)


def test_a_silent_rank_is_an_error_and_a_rank_without_rank_0_ends_itself() -> None:
    leader = LeaderLink("127.0.0.1", 2, heartbeat_s=0.1)
    a = leader.addresses
    proc = subprocess.Popen(
        [sys.executable, "-c", FOLLOWER, a.work, a.fetch, a.beat],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        leader.wait_followers(60.0)
        leader.command(Publish())
        with pytest.raises(RankSilentError, match=r"ranks \[1\] did not answer within 0.5 s"):
            leader.replies(0.5)
        time.sleep(2.0)  # heartbeats keep the rank alive well past its dead_after_s
        assert proc.poll() is None
    finally:
        leader.close()  # rank 0 goes quiet
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == THREAD_DIED
    assert b"heard nothing from rank 0" in err


def test_the_launcher_takes_every_rank_down_when_one_fails(tmp_path: Path) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['RANK'] == '1':\n"
        "    sys.exit(3)\n"
        "time.sleep(600)\n"  # rank 0 would wait for ever
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gyre_train.launch",
            "--nproc",
            "2",
            "--preload",
            "",
            "--grace-s",
            "1",
            str(script),
        ],
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 3
    assert b"rank 1 exited with 3; stopping the others" in done.stderr
